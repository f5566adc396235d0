"""Checkpoint import: timm, CVNets and our own Lightning checkpoints load into our backbones
and give the reference's outputs; mismatches are refused with the offending keys named."""
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from backbones.mobilevit import MobileViT
from backbones.mobilevitv2 import MobileViTv2
from backbones.weights import (
    classifier_state,
    convert_checkpoint,
    load_pretrained,
    register_converter,
)

timm = pytest.importorskip("timm")


def timm_model(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
    return model


def pooled(model, x):
    with torch.no_grad():
        return model.forward_head(model.forward_features(x), pre_logits=True)


@pytest.fixture(scope="module")
def v2_reference():
    return timm_model("mobilevitv2_050")


def test_timm_state_dict_file_loads_via_pretrained_argument(tmp_path, v2_reference):
    path = tmp_path / "timm.pth"
    torch.save(v2_reference.state_dict(), path)
    ours = MobileViTv2(width=0.5, pretrained=str(path)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_pooled(x), pooled(v2_reference, x), rtol=1e-4, atol=1e-5)


def test_lightning_checkpoint_round_trip_with_classifier(tmp_path, v2_reference):
    source = MobileViTv2(width=0.5).eval()
    load_pretrained_from = tmp_path / "timm.pth"
    torch.save(v2_reference.state_dict(), load_pretrained_from)
    load_pretrained(source, load_pretrained_from)
    fc = nn.Linear(source.num_features, 10)
    state = {f"backbone.{k}": v for k, v in source.state_dict().items()}
    state |= {"head.fc.weight": fc.weight.detach(), "head.fc.bias": fc.bias.detach()}
    ckpt = tmp_path / "epoch=3.ckpt"
    torch.save({"state_dict": state, "epoch": 3, "global_step": 12, "pytorch-lightning_version": "2.6.6"}, ckpt)

    ours = MobileViTv2(width=0.5, pretrained=str(ckpt)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_pooled(x), source.forward_pooled(x))
    canonical = convert_checkpoint(ckpt, ours)
    torch.testing.assert_close(classifier_state(canonical, 10)["weight"], fc.weight.detach())
    with pytest.warns(UserWarning, match="10 classes, the model 5"):
        assert classifier_state(canonical, 5) == {}


def timm_to_cvnets_v2(key: str) -> str:
    """CVNets names (cvnets/models/classification/mobilevit_v2.py, cvnets/modules/{mobilenetv2,
    mobilevit_block,transformer}.py, ConvLayer2d = block.{conv,norm}) written from timm's, table by table."""
    conv = {"conv": "block.conv", "bn": "block.norm"}
    parts = key.split(".")
    if parts[0] == "stem":
        return f"conv_1.{conv[parts[1]]}.{parts[2]}"
    if parts[0] == "head":
        return f"classifier.1.{parts[2]}"
    _, i, j, module, *rest = parts
    prefix = f"layer_{int(i) + 1}.{j}"
    mv2 = {"conv1_1x1": "exp_1x1", "conv2_kxk": "conv_3x3", "conv3_1x1": "red_1x1"}
    if module in mv2:
        return f"{prefix}.block.{mv2[module]}.{conv[rest[0]]}.{rest[1]}"
    if module == "conv_kxk":
        return f"{prefix}.local_rep.0.{conv[rest[0]]}.{rest[1]}"
    if module == "conv_1x1":
        return f"{prefix}.local_rep.1.block.conv.{rest[0]}"
    if module == "conv_proj":
        return f"{prefix}.conv_proj.{conv[rest[0]]}.{rest[1]}"
    if module == "norm":  # the norm after the last attention layer: global_rep[depth]
        return f"{prefix}.global_rep.{DEPTH_V2[int(i)]}.{rest[0]}"
    layer, sub, *tail = rest  # transformer.<layer>.<sub>...
    inner = {
        ("norm1",): "pre_norm_attn.0",
        ("attn", "qkv_proj"): "pre_norm_attn.1.qkv_proj.block.conv",
        ("attn", "out_proj"): "pre_norm_attn.1.out_proj.block.conv",
        ("norm2",): "pre_norm_ffn.0",
        ("mlp", "fc1"): "pre_norm_ffn.1.block.conv",
        ("mlp", "fc2"): "pre_norm_ffn.3.block.conv",
    }
    name = inner[(sub,)] if sub.startswith("norm") else inner[(sub, tail[0])]
    return f"{prefix}.global_rep.{layer}.{name}.{tail[-1]}"


DEPTH_V2 = DEPTH_V1 = {2: 2, 3: 4, 4: 3}  # transformer layers per stage; the final norm comes after them


def test_cvnets_checkpoint_loads(tmp_path, v2_reference):
    cvnets = OrderedDict(
        (timm_to_cvnets_v2(k), v) for k, v in v2_reference.state_dict().items() if not k.endswith("num_batches_tracked")
    )
    assert "layer_3.1.global_rep.2.weight" in cvnets and "classifier.1.weight" in cvnets
    path = tmp_path / "mobilevitv2-0.5.pt"
    torch.save(cvnets, path)
    ours = MobileViTv2(width=0.5, pretrained=str(path)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_pooled(x), pooled(v2_reference, x), rtol=1e-4, atol=1e-5)
    assert set(convert_checkpoint(path, ours)) >= {"head.fc.weight", "head.fc.bias"}


def test_cvnets_v1_transformer_names_load(tmp_path):
    """v1 uses Linear layers inside the transformer and a named classifier (classifier.fc)."""
    reference = timm_model("mobilevit_xxs")
    rules = [  # CVNets v1 names of the modules that differ from v2 (cvnets/modules/transformer.py)
        (r"transformer\.(\d+)\.norm1\.", r"global_rep.\1.pre_norm_mha.0."),
        (r"transformer\.(\d+)\.attn\.qkv\.", r"global_rep.\1.pre_norm_mha.1.qkv_proj."),
        (r"transformer\.(\d+)\.attn\.proj\.", r"global_rep.\1.pre_norm_mha.1.out_proj."),
        (r"transformer\.(\d+)\.norm2\.", r"global_rep.\1.pre_norm_ffn.0."),
        (r"transformer\.(\d+)\.mlp\.fc1\.", r"global_rep.\1.pre_norm_ffn.1."),
        (r"transformer\.(\d+)\.mlp\.fc2\.", r"global_rep.\1.pre_norm_ffn.4."),
        (r"^stages\.(\d)\.1\.norm\.", lambda m: f"stages.{m.group(1)}.1.global_rep.{DEPTH_V1[int(m.group(1))]}."),
        (r"\.conv_kxk\.", ".local_rep.conv_3x3."),
        (r"\.conv_1x1\.weight", ".local_rep.conv_1x1.conv.weight"),
        (r"\.conv_fusion\.", ".fusion."),
        (r"^final_conv\.", "conv_1x1_exp."),
        (r"^stem\.", "conv_1."),
        (r"\.conv1_1x1\.", ".block.exp_1x1."),
        (r"\.conv2_kxk\.", ".block.conv_3x3."),
        (r"\.conv3_1x1\.", ".block.red_1x1."),
        (r"\.(conv|bn)\.(weight|bias|running_mean|running_var|num_batches_tracked)$",
         lambda m: f".block.{'conv' if m.group(1) == 'conv' else 'norm'}.{m.group(2)}"),
        (r"^stages\.(\d)\.", lambda m: f"layer_{int(m.group(1)) + 1}."),
        (r"^head\.fc\.", "classifier.fc."),
    ]
    state = {}
    for key, value in reference.state_dict().items():
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        state[key] = value
    assert "layer_3.1.global_rep.0.pre_norm_mha.1.qkv_proj.weight" in state
    assert "conv_1x1_exp.block.conv.weight" in state and "layer_5.1.fusion.block.norm.running_var" in state
    path = tmp_path / "mobilevit_xxs.pt"
    torch.save(state, path)
    ours = MobileViT("xxs", pretrained=str(path)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_pooled(x), pooled(reference, x), rtol=1e-4, atol=1e-5)


def test_mismatches_are_refused_with_the_keys_named(tmp_path, v2_reference):
    path = tmp_path / "w050.pth"
    torch.save(v2_reference.state_dict(), path)
    with pytest.raises(ValueError, match=r"shape mismatches: stem\.conv\.weight: checkpoint \(16, 3, 3, 3\)"):
        MobileViTv2(width=0.75, pretrained=str(path))

    state = {f"backbone.{k}": v for k, v in MobileViTv2(width=0.5).state_dict().items()}
    del state["backbone.stages.2.1.norm.weight"]
    state["backbone.stages.9.extra.weight"] = torch.zeros(1)
    torch.save({"state_dict": state}, path)
    with pytest.raises(ValueError) as err:
        MobileViTv2(width=0.5, pretrained=str(path))
    assert "missing keys: stages.2.1.norm.weight" in str(err.value)
    assert "unexpected keys: stages.9.extra.weight" in str(err.value)


def test_unknown_naming_pickles_and_missing_files_are_clear_errors(tmp_path):
    path = tmp_path / "odd.pth"
    torch.save({"encoder.layer0.weight": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="unrecognised checkpoint naming for backbone 'mobilevitv2'.*timm, cvnets"):
        MobileViTv2(width=0.5, pretrained=str(path))
    torch.save({"state_dict": {}, "callback": OrderedDict, "obj": nn.Identity()}, path)
    with pytest.raises(ValueError, match="weights_only=True"):
        MobileViTv2(width=0.5, pretrained=str(path))
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        MobileViTv2(width=0.5, pretrained=str(tmp_path / "nope.pth"))


def test_ddp_prefix_and_registered_converters(tmp_path, v2_reference):
    path = tmp_path / "ddp.pth"
    torch.save({f"module.{k}": v for k, v in v2_reference.state_dict().items()}, path)
    MobileViTv2(width=0.5, pretrained=str(path))  # timm names under DDP's prefix

    @register_converter("mobilevitv2", "test-format", detect=lambda sd: "test_format.marker" in sd)
    def _from_test_format(state_dict, backbone):
        return {f"backbone.{k}": v for k, v in state_dict.items() if k != "test_format.marker"}

    state = dict(MobileViTv2(width=0.5).state_dict()) | {"test_format.marker": torch.zeros(1)}
    torch.save(state, path)
    ours = MobileViTv2(width=0.5, pretrained=str(path))
    torch.testing.assert_close(ours.stem.conv.weight, state["stem.conv.weight"])
