"""Checkpoint import: timm, CVNets and our own Lightning checkpoints load into our backbones
and give the reference's outputs; mismatches are refused with the offending keys named. Registered
weights (backbones/pretrained.py) load by name from their file and say what input they were trained on."""
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from backbones.mobilevit import MobileViT
from backbones.mobilevitv2 import MobileViTv2
from backbones.pretrained import IMAGENET_MEAN, IMAGENET_STD, PRETRAINED, Preprocessing
from backbones.registry import get_backbone_class
from backbones.vit import ViT
from backbones.weights import (
    classifier_state,
    convert_checkpoint,
    converters_for,
    load_pretrained,
    preprocessing_of,
    register_converter,
)
from datamodules.input_spec import InputSpec

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


def cvnets_state_dict(reference) -> OrderedDict:
    """timm's MobileViTv2 state dict under CVNets' names, as its model-zoo files hold it."""
    return OrderedDict((timm_to_cvnets_v2(k), v) for k, v in reference.state_dict().items()
                       if not k.endswith("num_batches_tracked"))


def test_cvnets_checkpoint_loads(tmp_path, v2_reference):
    cvnets = cvnets_state_dict(v2_reference)
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


def test_registered_weights_without_their_file_say_where_to_get_them(tmp_path, monkeypatch):
    """Offline, a registered name that is neither in the working directory nor in the cache is refused in one
    line naming the address it is published at and the cache path to put it at (downloads:
    test_weights_download.py)."""
    from backbones.download import WeightsUnavailable
    from backbones.pretrained import find_weights

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUITE_OFFLINE", "1")
    monkeypatch.setenv("SUITE_WEIGHTS_DIR", str(tmp_path / "cache"))
    entry = find_weights("mobilevitv2_050.cvnets_in1k")
    with pytest.raises(WeightsUnavailable) as err:
        MobileViTv2(width=0.5, pretrained=entry.name)
    message = str(err.value)
    assert entry.name in message and entry.url in message and "\n" not in message
    assert str(tmp_path / "cache" / entry.name / "mobilevitv2-0.5.pt") in message
    assert isinstance(err.value, FileNotFoundError)  # callers that catch a missing file still do


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


# -- registered weights ----------------------------------------------------------------------------------------
def put_at_entry_file(name: str, state: dict, root) -> str:
    """Save ``state`` where registered weights ``name`` are read from, under ``root`` (the working directory)."""
    path = root / PRETRAINED.get(name).file
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return PRETRAINED.get(name).file


def test_registered_cvnets_weights_load_by_name_and_their_file_says_it_is_unnormalised(tmp_path, monkeypatch,
                                                                                      v2_reference):
    monkeypatch.chdir(tmp_path)
    file = put_at_entry_file("mobilevitv2_050.cvnets_in1k", cvnets_state_dict(v2_reference), tmp_path)
    assert file == "checkpoints/imagenet1k_256/mobilevitv2-0.5.pt"  # the path the recipes named before
    ours = MobileViTv2(width=0.5, pretrained="mobilevitv2_050.cvnets_in1k").eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_pooled(x), pooled(v2_reference, x), rtol=1e-4, atol=1e-5)
    # given by its path, the file is known as CVNets' by its keys: CVNets feeds [0, 1] pixels
    by_path = preprocessing_of(file)
    assert (by_path.mean, by_path.std) == ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    # the published evaluation input, as timm's pretrained_cfg for these weights gives it
    assert InputSpec.of_weights("mobilevitv2_050.cvnets_in1k") == InputSpec(
        "center_crop", 256, 288, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), "bicubic")


def test_registered_timm_weights_load_by_name_and_a_timm_file_alone_does_not_say_its_tag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    deit = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    file = put_at_entry_file("deit_tiny_patch16_224.fb_in1k", deit.state_dict(), tmp_path)
    ours = ViT(size="tiny", patch_size=16, img_size=224, pretrained="deit_tiny_patch16_224.fb_in1k")
    torch.testing.assert_close(ours.pos_embed, deit.pos_embed)
    assert preprocessing_of("deit_tiny_patch16_224.fb_in1k").mean == IMAGENET_MEAN
    assert preprocessing_of("vit_small_patch16_224.augreg_in21k_ft_in1k").mean == (0.5, 0.5, 0.5)
    # timm's ViT keys fit DeiT's tags (ImageNet's mean) and AugReg's (0.5) alike: the file alone cannot tell
    assert preprocessing_of(file) is None


def test_registered_weights_are_refused_for_another_family_and_over_a_file_trained_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"mobilevitv2_050.cvnets_in1k are weights of a mobilevitv2 backbone "
                                         r"\{'width': 0.5\}, not of this mobilevit"):
        MobileViT("xxs", pretrained="mobilevitv2_050.cvnets_in1k")
    with pytest.raises(ValueError, match=r"names neither registered weights \(closest: mobilevitv2_050.cvnets_in1k"):
        MobileViTv2(width=0.5, pretrained="mobilevitv2_050.cvnet_in1k")
    # a checkpoint of ours trained on ImageNet-normalised input, where the CVNets weights belong
    spec = InputSpec.center_crop(256, 288, IMAGENET_MEAN, IMAGENET_STD, "bicubic").to_dict()
    state = {f"backbone.{k}": v for k, v in MobileViTv2(width=0.5).state_dict().items()}
    file = put_at_entry_file("mobilevitv2_050.cvnets_in1k", {"state_dict": state, "input_spec": spec}, tmp_path)
    with pytest.raises(ValueError, match=r"normalised with mean \[0.485, 0.456, 0.406\].*states mean \[0.0, 0.0, "
                                         r"0.0\].*pass this file's path as pretrained"):
        MobileViTv2(width=0.5, pretrained="mobilevitv2_050.cvnets_in1k")
    MobileViTv2(width=0.5, pretrained=file)  # by its path it loads, and says its own input
    assert preprocessing_of(file) == Preprocessing(IMAGENET_MEAN, IMAGENET_STD, 256, 288, "bicubic")


def test_every_entry_fits_a_registered_backbone_and_converter():
    import inspect

    for name, entry in PRETRAINED.items():
        assert name == entry.name.lower() and re.fullmatch(r"[a-z0-9_]+\.[a-z0-9_]+", name), name
        parameters = inspect.signature(get_backbone_class(entry.backbone)).parameters
        assert set(entry.arguments) <= set(parameters), (name, set(entry.arguments) - set(parameters))
        assert entry.converter == "ours" or entry.converter in converters_for(entry.backbone), name
        assert entry.preprocessing.resize_size >= entry.preprocessing.input_size, name
