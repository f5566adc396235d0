"""Activation checkpointing (``--model.activation_checkpointing``, :mod:`layers.checkpointing`): the same outputs
and gradients as without (dropout and BatchNorm statistics included), fewer bytes kept for the backward pass,
state-dict keys unchanged, and it composes with channels-last and regional compilation."""
import copy
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from backbones import ConvMixer, ViT
from backbones.mobilevitv2 import MobileViTv2
from layers.checkpointing import checkpoint_blocks, checkpoint_networks, is_checkpointed
from layers.compile import compile_regions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_checkpointing import saved_for_backward_bytes  # noqa: E402


def loss_and_gradients(model: nn.Module, x: torch.Tensor, seed: int = 0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model.forward_pooled(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def pair(build):
    torch.manual_seed(0)
    plain = build().train()
    checkpointed = copy.deepcopy(plain)
    blocks = checkpoint_blocks(checkpointed)
    assert blocks and all(is_checkpointed(block) for _, block in blocks)
    return plain, checkpointed


BUILDS = {
    "mobilevitv2": (lambda: MobileViTv2(width=0.5), (2, 3, 64, 64)),
    "vit": (lambda: ViT("tiny", depth=3, img_size=32), (2, 3, 32, 32)),
}


@pytest.mark.parametrize("name", BUILDS)
def test_gradients_equal_those_without_and_keys_are_unchanged(name):
    build, shape = BUILDS[name]
    plain, checkpointed = pair(build)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    x = torch.randn(shape)
    loss, grads = loss_and_gradients(plain, x)
    loss_ckpt, grads_ckpt = loss_and_gradients(checkpointed, x)
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys()
    torch.testing.assert_close(grads_ckpt, grads)


@pytest.mark.parametrize("name", BUILDS)
def test_fewer_bytes_are_kept_for_the_backward(name):
    build, shape = BUILDS[name]
    plain, checkpointed = pair(build)
    x = torch.randn(shape)
    without = saved_for_backward_bytes(plain, x, plain.forward_pooled)
    with_ = saved_for_backward_bytes(checkpointed, x, checkpointed.forward_pooled)
    assert with_ < 0.9 * without, (with_, without)


def test_dropout_and_stochastic_depth_draw_the_same_masks_when_recomputed():
    plain, checkpointed = pair(lambda: MobileViTv2(width=0.5, dropout=0.2, attn_dropout=0.2, drop_path_rate=0.2))
    x = torch.randn(2, 3, 64, 64)
    loss, grads = loss_and_gradients(plain, x, seed=3)
    loss_ckpt, grads_ckpt = loss_and_gradients(checkpointed, x, seed=3)
    torch.testing.assert_close(loss_ckpt, loss)
    torch.testing.assert_close(grads_ckpt, grads)
    _, other_masks = loss_and_gradients(plain, x, seed=4)  # the test would see other masks
    assert any(not torch.equal(other_masks[k], grads[k]) for k in grads)


def test_batchnorm_statistics_are_updated_once_not_again_when_recomputed():
    plain, checkpointed = pair(lambda: ConvMixer(dim=32, depth=2, kernel_size=3, patch_size=4))
    x = torch.randn(2, 3, 32, 32)
    _, grads = loss_and_gradients(plain, x)
    _, grads_ckpt = loss_and_gradients(checkpointed, x)
    torch.testing.assert_close(grads_ckpt, grads)
    torch.testing.assert_close(dict(checkpointed.named_buffers()), dict(plain.named_buffers()))
    assert checkpointed.blocks[0].norm1.num_batches_tracked.item() == 1


def test_channels_last_composes():
    plain, checkpointed = pair(lambda: MobileViTv2(width=0.5))
    for model in (plain, checkpointed):
        model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(loss_and_gradients(checkpointed, x), loss_and_gradients(plain, x))


def test_without_gradients_the_blocks_run_as_they_are():
    plain, checkpointed = pair(lambda: ViT("tiny", depth=2, img_size=32))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(checkpointed.eval().forward_pooled(x), plain.eval().forward_pooled(x))


def test_copies_keep_their_own_wrapper():
    """EMA weight averaging deep-copies the task; the copy's wrapper must run the copy's weights."""
    _, checkpointed = pair(lambda: ViT("tiny", depth=2, img_size=32))
    for copied in (copy.deepcopy(checkpointed), pickle.loads(pickle.dumps(checkpointed))):
        block = copied.blocks[0]
        assert is_checkpointed(block) and block.forward.block is block
    with torch.no_grad():
        for p in copied.parameters():
            p.zero_()
    x = torch.randn(1, 3, 32, 32)
    assert not torch.equal(checkpointed.forward_pooled(x), copied.forward_pooled(x))


def test_task_module_checkpoints_its_networks_in_configure_model():
    from tasks.classify import ClassificationTask

    task = ClassificationTask(MobileViTv2(width=0.5), class_names=["a", "b"], activation_checkpointing=True)
    keys = list(task.state_dict())
    task.configure_model()
    blocks = [m for m in task.backbone.modules() if type(m).__name__ == "TransformerBlock"]
    assert len(blocks) == 9 and all(is_checkpointed(block) for block in blocks)
    assert list(task.state_dict()) == keys
    assert not any(is_checkpointed(m) for m in task.head.modules())
    with pytest.raises(ValueError, match="no repeated blocks"):
        checkpoint_networks([nn.Linear(2, 2)])


@pytest.mark.slow  # compiles a block with inductor: tens of seconds on the CPU
def test_regional_compile_of_checkpointed_blocks_gives_the_same_gradients():
    plain, checkpointed = pair(lambda: ViT("tiny", depth=2, img_size=32))
    compile_regions(checkpointed)
    x = torch.randn(2, 3, 32, 32)
    loss, grads = loss_and_gradients(plain, x)
    loss_ckpt, grads_ckpt = loss_and_gradients(checkpointed, x)
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads_ckpt, grads, rtol=1e-3, atol=1e-5)
