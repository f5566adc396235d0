"""Recipes stack: a recipe names the one it overrides with ``base:``, an overlay given on its own
stacks on the task's default recipe, and ``--print_config`` shows the resolved whole."""
from pathlib import Path

import pytest
import yaml

from tasks.engine.recipes import recipe_path, with_default_config
from tests.conftest import REPO


def resolved(task: str, *args: str, capsys) -> dict:
    import importlib

    main = importlib.import_module(f"tasks.{task}").main
    with pytest.raises(SystemExit) as done:
        main(["fit", *args, "--print_config"])
    assert done.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_overlay_alone_stacks_on_the_default_recipe(tmp_path, capsys):
    overlay = tmp_path / "longer.yaml"
    overlay.write_text("trainer:\n  max_epochs: 3\ndata:\n  batch_size: 5\n")
    config = resolved("classify", "--config", str(overlay), capsys=capsys)
    demo = yaml.safe_load(recipe_path("classify", "demo_mobilevitv2.yaml").read_text())
    assert config["trainer"]["max_epochs"] == 3 and config["data"]["init_args"]["batch_size"] == 5
    # everything the overlay does not mention is the demo recipe's
    assert config["model"]["backbone"]["init_args"]["width"] == demo["model"]["backbone"]["init_args"]["width"]
    assert config["data"]["init_args"]["image_size"] == demo["data"]["image_size"]


def test_width_variant_is_its_base_plus_what_differs(capsys):
    base = resolved("detect", "--config", str(REPO / "configs/detect/coco_ssdlite_mobilevitv2_100.yaml"), capsys=capsys)
    variant = resolved("detect", "--config", str(REPO / "configs/detect/coco_ssdlite_mobilevitv2_075.yaml"),
                       capsys=capsys)
    assert variant["model"]["backbone"]["init_args"]["width"] == 0.75
    variant["model"]["backbone"]["init_args"]["width"] = 1.0
    # each width starts from its own ImageNet checkpoint
    variant["model"]["backbone"]["init_args"]["pretrained"] = base["model"]["backbone"]["init_args"]["pretrained"]
    assert variant == base  # and nothing else differs, in particular nothing of the demo recipe leaks in
    assert base["model"]["head"]["init_args"]["output_strides"][:2] == [16, 32]


def test_every_shipped_overlay_names_an_existing_base():
    for recipe in sorted((REPO / "configs").glob("*/*.yaml")):
        content = yaml.safe_load(recipe.read_text())
        if content.get("base"):
            assert (recipe.parent / content["base"]).is_file(), recipe


def test_base_chains_expand_in_order_and_cycles_are_refused(tmp_path):
    default = tmp_path / "default.yaml"
    default.write_text("trainer: {max_epochs: 1}\n")
    (tmp_path / "a.yaml").write_text("base: null\ntrainer: {max_epochs: 2}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrainer: {max_epochs: 3}\n")
    args = with_default_config(["fit", "--config", str(tmp_path / "b.yaml")], default)
    layers = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
    assert [yaml.safe_load(layer)["trainer"]["max_epochs"] for layer in layers] == [2, 3]
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ValueError, match="its own base"):
        with_default_config(["fit", "--config", str(tmp_path / "c.yaml")], default)
    (tmp_path / "e.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="names base: missing.yaml"):
        with_default_config(["fit", "--config", str(tmp_path / "e.yaml")], default)


def test_a_default_recipe_that_names_a_base_is_expanded(tmp_path):
    """The segmentation default is an overlay (ConvMixer on the MobileViTv2 demo recipe): with no
    ``--config``, and under an overlay given alone, its whole base chain is stacked, never its ``base`` key."""
    (tmp_path / "full.yaml").write_text("trainer: {max_epochs: 1}\ndata: {batch_size: 4}\n")
    default = tmp_path / "default.yaml"
    default.write_text("base: full.yaml\ntrainer: {max_epochs: 2}\n")
    (tmp_path / "overlay.yaml").write_text("data: {batch_size: 8}\n")

    def layers(args):  # each --config value is a recipe file or the YAML text of an overlay
        values = [args[i + 1] for i, a in enumerate(args) if a == "--config"]
        found = [yaml.safe_load(Path(v).read_text() if v.endswith(".yaml") else v) for v in values]
        assert all("base" not in layer for layer in found), found
        return found

    alone = layers(with_default_config(["fit"], default))
    assert alone == [{"trainer": {"max_epochs": 1}, "data": {"batch_size": 4}}, {"trainer": {"max_epochs": 2}}]
    stacked = layers(with_default_config(["fit", "--config", str(tmp_path / "overlay.yaml")], default))
    assert stacked == alone + [{"data": {"batch_size": 8}}]


def test_segmentation_default_is_the_convmixer_demo_and_the_mobilevitv2_demo_stays_complete(capsys):
    default = resolved("segment", capsys=capsys)
    assert default["model"]["backbone"]["class_path"] == "backbones.convmixer.ConvMixer"
    assert default["data"]["init_args"]["root"] is None  # the embedded digit scenes
    mobilevit = resolved("segment", "--config", str(recipe_path("segment", "demo_deeplabv3_mobilevitv2.yaml")),
                         capsys=capsys)
    assert mobilevit["model"]["backbone"] == {
        "class_path": "backbones.MobileViTv2",
        "init_args": {**mobilevit["model"]["backbone"]["init_args"], "width": 0.5, "output_stride": 8}}
    assert "dim" not in mobilevit["model"]["backbone"]["init_args"]  # nothing of ConvMixer's leaks in
    # the two demos differ in their backbone and schedule only
    assert (default["trainer"]["max_epochs"], mobilevit["trainer"]["max_epochs"]) == (28, 33)
    for config in (default, mobilevit):
        config["model"].pop("backbone")
        for key in ("max_epochs", "check_val_every_n_epoch"):
            config["trainer"].pop(key)
    assert default == mobilevit
