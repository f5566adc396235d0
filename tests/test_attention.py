"""Behaviour of every attention variant: shapes, masks, causality, gradients, KV cache."""
import pytest
import torch
import torch.nn as nn

from layers.attention import KVCache, MultiHeadAttention, build_attention, list_attention

DIM, HEADS, MAX_LEN = 32, 4, 16
KWARGS = {"linformer": {"max_len": MAX_LEN, "proj_len": 8}, "synthesizer_dense": {"max_len": MAX_LEN},
          "synthesizer_random": {"max_len": MAX_LEN}}
ALL = ["mha", "separable", "linformer", "synthesizer_dense", "synthesizer_random", "additive"]
CAUSAL = [n for n in ALL if n != "linformer"]
CROSS = ["mha", "linformer", "synthesizer_dense", "synthesizer_random", "additive"]


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return build_attention(name, DIM, HEADS, **KWARGS.get(name, {})).eval()


def test_registry_lists_every_variant_and_rejects_unknown_names():
    assert set(ALL) <= set(list_attention())
    with pytest.raises(KeyError, match="valid names: .*mha"):
        build_attention("flash9000", DIM, HEADS)


@pytest.mark.parametrize("name", ALL)
def test_shape_and_gradient_flow(name):
    attn = make(name).train()
    x = torch.randn(2, 10, DIM, requires_grad=True)
    y = attn(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for pname, p in attn.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", CROSS)
def test_cross_attention_shape(name):
    attn = make(name)
    q, mem = torch.randn(2, 5, DIM), torch.randn(2, 9, DIM)
    assert attn(q, mem).shape == (2, 5, DIM)


@pytest.mark.parametrize("name", ALL)
def test_padded_keys_never_change_valid_outputs(name):
    attn = make(name)
    x = torch.randn(2, 10, DIM)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, 7:] = True
    pad[1, 4:] = True
    y = attn(x, key_padding_mask=pad)
    x2 = x.clone()
    x2[pad] = torch.randn(int(pad.sum()), DIM) * 10  # rewrite what sits in the padding
    y2 = attn(x2, key_padding_mask=pad)
    torch.testing.assert_close(y[~pad], y2[~pad], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CAUSAL)
def test_future_tokens_never_influence_the_past(name):
    attn = make(name)
    x = torch.randn(2, 10, DIM)
    y = attn(x, is_causal=True)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 4, DIM)
    y2 = attn(x2, is_causal=True)
    torch.testing.assert_close(y[:, :6], y2[:, :6], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y[:, 6:], y2[:, 6:])


def test_linformer_refuses_causal_mode_and_cache():
    attn = make("linformer")
    with pytest.raises(ValueError, match="no causal mode"):
        attn(torch.randn(1, 4, DIM), is_causal=True)
    with pytest.raises(ValueError, match="max_len=16"):
        attn(torch.randn(1, MAX_LEN + 1, DIM))


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 3, 1]])
def test_kv_cache_matches_full_causal_pass(name, chunks):
    attn = make(name)
    x = torch.randn(2, sum(chunks), DIM)
    full = attn(x, is_causal=True)
    cache, outs, start = KVCache(), [], 0
    for n in chunks:
        outs.append(attn(x[:, start : start + n], is_causal=True, kv_cache=cache))
        start += n
    assert cache.steps == x.shape[1]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mha", "synthesizer_dense", "synthesizer_random", "additive"])
def test_static_cache_reuses_projected_memory_for_cross_attention(name):
    attn = make(name)
    q, mem = torch.randn(2, 6, DIM), torch.randn(2, 9, DIM)
    full = attn(q, mem)
    cache = KVCache(static=True)
    steps = [attn(q[:, :1], mem, kv_cache=cache)]
    steps += [attn(q[:, t : t + 1], None, kv_cache=cache) for t in range(1, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_project_memory_gives_the_keys_and_values_a_static_cache_holds():
    """What an exported encoder computes ahead: a cache filled with them attends as the first call would."""
    attn = make("mha")
    q, mem, values = torch.randn(2, 3, DIM), torch.randn(2, 9, DIM), torch.randn(2, 9, DIM)
    for value in (None, values):
        cache = KVCache(static=True)
        first = attn(q, mem, value, kv_cache=cache)
        keys, projected = attn.project_memory(mem, value)
        assert keys.shape == projected.shape == (2, HEADS, 9, DIM // HEADS)
        assert torch.equal(keys, cache.key) and torch.equal(projected, cache.value)
        ahead = KVCache(key=keys, value=projected, static=True)
        assert torch.equal(attn(q, None, kv_cache=ahead), first)


def test_mha_equals_torch_multihead_attention_with_masks():
    """Same weights in nn.MultiheadAttention: same outputs under padding + causal masks."""
    attn = make("mha")
    ref = nn.MultiheadAttention(DIM, HEADS, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(attn.qkv.weight)
        ref.in_proj_bias.copy_(attn.qkv.bias)
        ref.out_proj.weight.copy_(attn.proj.weight)
        ref.out_proj.bias.copy_(attn.proj.bias)
    q, mem = torch.randn(2, 7, DIM), torch.randn(2, 7, DIM)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)
    ours = attn(q, mem, key_padding_mask=pad, attn_mask=causal)
    theirs, _ = ref(q, mem, mem, key_padding_mask=pad, attn_mask=causal, need_weights=False)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn(q, is_causal=True), ref(q, q, q, attn_mask=causal, need_weights=False)[0],
                               atol=1e-5, rtol=1e-5)


def test_separable_attention_is_eq3_of_the_paper():
    """y = (ReLU(x W_V) * sum_k softmax(x W_I)_k (x W_K)_k) W_O, written out by hand."""
    attn = make("separable")
    x = torch.randn(2, 10, DIM)
    w, b = attn.qkv.weight, attn.qkv.bias
    scores = (x @ w[:1].T + b[:1]).softmax(dim=1)
    keys = x @ w[1 : DIM + 1].T + b[1 : DIM + 1]
    values = x @ w[DIM + 1 :].T + b[DIM + 1 :]
    context = (scores * keys).sum(1, keepdim=True)
    expected = attn.proj(torch.relu(values) * context)
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="self-attention only"):
        attn(x, torch.randn(2, 3, DIM))


def test_separable_attention_on_a_patch_grid_equals_it_on_the_unfolded_sequences():
    """MobileViTv2's path: the map's free (B, N_h, P_h, N_w, P_w, D) view, tokens on dims 1 and 3, one softmax
    over them; the same outputs and gradients as the (B * P, N, D) sequences the reference unfolds."""
    attn = make("separable")
    grid = torch.randn(2, 3, 2, 4, 2, DIM, requires_grad=True)
    sequences = grid.permute(0, 2, 4, 1, 3, 5).reshape(2 * 2 * 2, 3 * 4, DIM)
    expected = attn(sequences).view(2, 2, 2, 3, 4, DIM).permute(0, 3, 1, 4, 2, 5)
    out = attn.forward_grid(grid, token_dims=(1, 3))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (grid, attn.qkv.weight))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (grid, attn.qkv.weight))
    torch.testing.assert_close(grads, expected_grads, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_named():
    attn = MultiHeadAttention(DIM, HEADS)
    with pytest.raises(ValueError, match=r"\(B, N, 32\)"):
        attn(torch.randn(2, 5, DIM + 1))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attn(torch.randn(2, 5, DIM), key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(30, 4)
