"""The Transformer encoder/decoder: sizes of the paper, equality with torch.nn's reference
layers on copied weights, masks, the KV cache and tied embeddings."""
import math

import pytest
import torch
import torch.nn as nn

from backbones.transformer import TRANSFORMER_SIZES, TransformerEncoder
from heads.seq2seq import TransformerDecoder
from layers.attention import list_attention
from layers.transformer import ChannelsLastGroupNorm, sinusoidal_table

PAD = 0


def tiny_pair(vocab=40, dim=32, depth=2, heads=4, attention="mha", pre_norm=False, **kw):
    torch.manual_seed(0)
    enc = TransformerEncoder(vocab, dim, depth, heads, 2 * dim, 0.0, attention, pre_norm=pre_norm, max_positions=64, **kw)
    dec = TransformerDecoder(vocab, dim, depth, heads, 2 * dim, 0.0, pre_norm=pre_norm, max_positions=64,
                             embed_tokens=enc.embed.tokens)
    return enc.double().eval(), dec.double().eval()


def padded_batch(lengths, vocab=40, width=None):
    g = torch.Generator().manual_seed(1)
    width = width or max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), width), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n:] = PAD
    return ids


@pytest.mark.parametrize("size, paper_millions, vocab", [("base", 65, 37000), ("big", 213, 37000)])
def test_parameter_count_matches_the_paper(size, paper_millions, vocab):
    """Table 3 of Vaswani et al. (shared 37k BPE vocabulary, tied embeddings): 65M / 213M."""
    cfg = TRANSFORMER_SIZES[size]
    with torch.device("meta"):
        enc = TransformerEncoder(vocab, cfg["dim"], cfg["depth"], cfg["num_heads"], cfg["ffn_dim"])
        dec = TransformerDecoder(vocab, cfg["dim"], cfg["depth"], cfg["num_heads"], cfg["ffn_dim"],
                                 embed_tokens=enc.embed.tokens)
    params = {id(p): p.numel() for m in (enc, dec) for p in m.parameters()}  # the shared table once
    d, f, n = cfg["dim"], cfg["ffn_dim"], cfg["depth"]
    attention = 4 * d * d + 4 * d
    ffn = 2 * d * f + d + f
    expected = vocab * d + n * (attention + ffn + 2 * 2 * d) + n * (2 * attention + ffn + 3 * 2 * d)
    assert sum(params.values()) == expected
    assert abs(expected / 1e6 - paper_millions) / paper_millions < 0.05


def test_sinusoidal_positions_follow_the_formula():
    table = sinusoidal_table(50, 16)
    p, i = 37, 3
    assert table[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 16)), abs=1e-6)
    assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 16)), abs=1e-6)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_encoder_and_decoder_layers_equal_torch_reference_layers(pre_norm):
    """Our layers with weights copied into nn.TransformerEncoderLayer/DecoderLayer give the same outputs."""
    enc, dec = tiny_pair(pre_norm=pre_norm)
    d = 32
    ours_enc, ours_dec = enc.layers[0], dec.layers[0]
    ref_enc = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=pre_norm).double().eval()
    ref_dec = nn.TransformerDecoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=pre_norm).double().eval()

    def copy_attention(ref: nn.MultiheadAttention, ours):
        ref.in_proj_weight.data.copy_(ours.qkv.weight)
        ref.in_proj_bias.data.copy_(ours.qkv.bias)
        ref.out_proj.weight.data.copy_(ours.proj.weight)
        ref.out_proj.bias.data.copy_(ours.proj.bias)

    copy_attention(ref_enc.self_attn, ours_enc.self_attn)
    ref_enc.linear1.load_state_dict(ours_enc.ffn.fc1.state_dict())
    ref_enc.linear2.load_state_dict(ours_enc.ffn.fc2.state_dict())
    ref_enc.norm1.load_state_dict(ours_enc.attn_block.norm.state_dict())
    ref_enc.norm2.load_state_dict(ours_enc.ffn_block.norm.state_dict())
    for norm in (ref_enc.norm1, ref_enc.norm2):  # non-trivial norms so a swapped norm would show
        norm.weight.data.uniform_(0.5, 1.5)
    ours_enc.attn_block.norm.load_state_dict(ref_enc.norm1.state_dict())
    ours_enc.ffn_block.norm.load_state_dict(ref_enc.norm2.state_dict())

    copy_attention(ref_dec.self_attn, ours_dec.self_attn)
    copy_attention(ref_dec.multihead_attn, ours_dec.cross_attn)
    ref_dec.linear1.load_state_dict(ours_dec.ffn.fc1.state_dict())
    ref_dec.linear2.load_state_dict(ours_dec.ffn.fc2.state_dict())
    for i, (ref_norm, block) in enumerate(zip((ref_dec.norm1, ref_dec.norm2, ref_dec.norm3),
                                              (ours_dec.self_block, ours_dec.cross_block, ours_dec.ffn_block))):
        ref_norm.weight.data.uniform_(0.5, 1.5)
        ref_norm.bias.data.uniform_(-0.1, 0.1)
        block.norm.load_state_dict(ref_norm.state_dict())

    torch.manual_seed(2)
    x = torch.randn(3, 7, d, dtype=torch.double)
    memory = torch.randn(3, 5, d, dtype=torch.double)
    src_pad = torch.zeros(3, 7, dtype=torch.bool)
    src_pad[1, 4:] = True
    mem_pad = torch.zeros(3, 5, dtype=torch.bool)
    mem_pad[2, 3:] = True
    expected = ref_enc(x, src_key_padding_mask=src_pad)
    got = ours_enc(x, src_pad)
    keep = ~src_pad
    torch.testing.assert_close(got[keep], expected[keep])

    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.double)
    expected = ref_dec(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    torch.testing.assert_close(ours_dec(x, memory, mem_pad), expected)


@pytest.mark.parametrize("attention", ["mha", "separable", "linformer", "synthesizer_dense", "synthesizer_random",
                                       "additive"])
def test_padding_does_not_change_a_sentence_encoding(attention):
    assert attention in list_attention()
    kw = {"attention_kwargs": {"proj_len": 8}} if attention == "linformer" else {}
    enc, _ = tiny_pair(attention=attention, **kw)
    batch = padded_batch([6, 3, 9])
    memory, padding = enc(batch)
    assert padding.tolist() == batch.eq(PAD).tolist()
    for i, n in enumerate([6, 3, 9]):
        alone, _ = enc(batch[i : i + 1, :n])
        torch.testing.assert_close(memory[i : i + 1, :n], alone)


def encoded_pair():
    """A tiny model, an encoded padded source batch and a (B=2, T=6) target batch."""
    enc, dec = tiny_pair()
    memory, padding = enc(padded_batch([5, 3]))
    return dec, memory, padding, padded_batch([6, 6], width=6)


def test_decoder_is_causal_and_ignores_padded_memory():
    dec, memory, padding, tgt = encoded_pair()
    logits = dec(tgt, memory, padding)
    changed = tgt.clone()
    changed[:, 4] = 7  # a later token never changes earlier positions
    torch.testing.assert_close(dec(changed, memory, padding)[:, :4], logits[:, :4])
    noisy = memory.clone()
    noisy[padding] = 100.0  # whatever sits at padded memory positions is ignored
    torch.testing.assert_close(dec(tgt, noisy, padding), logits)


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference"])
@pytest.mark.parametrize("capacity", [64, 2])
def test_cached_incremental_decoding_equals_the_full_pass(inference, capacity, monkeypatch):
    # inference: autograd off, as beam search runs it; capacity 2: the cache grows twice
    import heads.seq2seq

    monkeypatch.setattr(heads.seq2seq, "INITIAL_CAPACITY", capacity)
    dec, memory, padding, tgt = encoded_pair()
    full = dec(tgt, memory, padding)
    cache = dec.new_cache()
    with torch.inference_mode(inference):
        steps = [dec(tgt[:, t : t + 1], memory, padding, cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.steps == 6 and cache.self_kv.shape[:3] == (dec.depth, 2, len(tgt))  # every layer's k and v
    # cross-attention keys/values were projected once, from the source length
    assert cache.cross_attn[0].key.shape[2] == 5 and cache.cross_attn[0].steps == 6


def test_output_projection_is_tied_to_the_shared_embedding():
    enc, dec = tiny_pair()
    assert dec.output_weight is enc.embed.tokens.weight
    assert enc.embed.tokens.weight[PAD].abs().sum() == 0
    src = padded_batch([4])
    memory, padding = enc(src)
    dec(padded_batch([3]), memory, padding).sum().backward()
    assert enc.embed.tokens.weight.grad is not None



def test_channels_last_group_norm_equals_group_norm_on_the_nchw_map():
    """MobileViTv2's one-group GroupNorm, run as layer norm over (H, W, C) of a channels-last map: nn.GroupNorm's
    outputs and gradients, its parameters and checkpoint keys."""
    torch.manual_seed(0)
    ours, reference = ChannelsLastGroupNorm(1, 6), nn.GroupNorm(1, 6)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.normal_()
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(2, 6, 5, 4, requires_grad=True)
    out = ours(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (x, ours.weight, ours.bias))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (x, reference.weight, reference.bias))
    torch.testing.assert_close(grads, expected_grads)
    with pytest.raises(ValueError, match="num_groups=2"):
        ChannelsLastGroupNorm(2, 6)
