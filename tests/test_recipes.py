"""Recipes stack: a recipe names the one it overrides with ``base:``, an overlay given on its own
stacks on the task's default recipe, layers merge as jsonargparse merges config files, and
``--print_config`` shows the resolved whole."""
import pytest
import yaml

from configs.recipes import merge, recipe_layers, recipe_path, resolve_recipes, split_command_line
from tests.conftest import REPO


def resolve(args: list[str], default) -> dict:
    return resolve_recipes(split_command_line(args), default)


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
    (tmp_path / "a.yaml").write_text("base: null\ntrainer: {max_epochs: 2, devices: 1}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrainer: {max_epochs: 3}\n")
    layers = recipe_layers(tmp_path / "b.yaml", default)
    assert [layer for _, layer in layers] == [{"trainer": {"max_epochs": 2, "devices": 1}}, {"trainer": {"max_epochs": 3}}]
    assert resolve(["fit", "--config", str(tmp_path / "b.yaml")], default) == {"trainer": {"max_epochs": 3, "devices": 1}}
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ValueError, match="its own base"):
        resolve(["fit", "--config", str(tmp_path / "c.yaml")], default)
    (tmp_path / "e.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="names base: missing.yaml"):
        resolve(["fit", "--config", str(tmp_path / "e.yaml")], default)
    with pytest.raises(FileNotFoundError, match="recipe nowhere.yaml does not exist"):
        resolve(["fit", "--config", "nowhere.yaml"], default)


def test_a_default_recipe_that_names_a_base_is_expanded(tmp_path):
    """The segmentation default is an overlay (ConvMixer on the MobileViTv2 demo recipe): with no
    ``--config``, and under an overlay given alone, its whole base chain is stacked, never its ``base`` key."""
    (tmp_path / "full.yaml").write_text("trainer: {max_epochs: 1}\ndata: {batch_size: 4}\n")
    default = tmp_path / "default.yaml"
    default.write_text("base: full.yaml\ntrainer: {max_epochs: 2}\n")
    (tmp_path / "overlay.yaml").write_text("data: {batch_size: 8}\n")
    alone = resolve(["fit"], default)
    assert alone == {"trainer": {"max_epochs": 2}, "data": {"batch_size": 4}}
    assert resolve(["fit", "--config", str(tmp_path / "overlay.yaml")], default) == {
        "trainer": {"max_epochs": 2}, "data": {"batch_size": 8}}
    assert resolve(["fit", "--config", str(default)], default) == alone  # the default is not stacked on itself
    assert resolve([], default) == {}  # no subcommand, no recipe: nothing is assumed


def test_layers_merge_as_jsonargparse_merges_config_files():
    """A class node naming another class replaces the node before it (nothing of the old class's arguments
    is kept); arguments alone, under ``init_args`` or beside the ``class_path``, merge into the class there;
    another path to the same class is the same class; lists replace."""
    base = {"model": {"backbone": {"class_path": "backbones.MobileViTv2", "init_args": {"width": 0.5, "pretrained": "a"}},
                      "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.1, "weight_decay": 0.05}}},
            "trainer": {"callbacks": [{"class_path": "x.A"}, {"class_path": "x.B"}], "max_epochs": 3}}
    layer = {"model": {"backbone": {"class_path": "backbones.convmixer.ConvMixer", "init_args": {"dim": 8}},
                       "optimizer": {"lr": 0.2}},
             "trainer": {"callbacks": [{"class_path": "x.C"}]}}
    assert merge(base, layer) == {
        "model": {"backbone": {"class_path": "backbones.convmixer.ConvMixer", "init_args": {"dim": 8}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.2, "weight_decay": 0.05}}},
        "trainer": {"callbacks": [{"class_path": "x.C"}], "max_epochs": 3}}
    same = {"model": {"backbone": {"class_path": "backbones.mobilevitv2.MobileViTv2", "init_args": {"width": 1.0}}}}
    assert merge(base, same)["model"]["backbone"] == {"class_path": "backbones.mobilevitv2.MobileViTv2",
                                                      "init_args": {"width": 1.0, "pretrained": "a"}}
    # arguments given before any class was named are the arguments of the class named later
    assert merge({"data": {"batch_size": 4}}, {"data": {"class_path": "x.D", "init_args": {"root": "r"}}}) == {
        "data": {"class_path": "x.D", "init_args": {"batch_size": 4, "root": "r"}}}
    assert base["model"]["optimizer"]["init_args"]["lr"] == 0.1  # the layers themselves are left as they were


def test_flag_before_a_recipe_that_sets_it_is_refused():
    demo = recipe_path("classify", "demo_mobilevitv2.yaml")
    with pytest.raises(ValueError, match=r"--data.batch_size comes before --config .*demo_mobilevitv2.yaml, which "
                                         r"sets data.batch_size too .*Put the flag after the --config"):
        resolve(["fit", "--data.batch_size", "8", "--config", str(demo)], demo)
    # the default recipe goes under a first --config overlay: a flag before it would lose to that too
    overlay = REPO / "configs/classify/demo_mobilevitv2_mha.yaml"
    with pytest.raises(ValueError, match=r"--model.optimizer.init_args.lr comes before"):
        resolve(["fit", "--model.optimizer.init_args.lr", "0.1", "--config", str(overlay)], demo)
    # flags after the recipe, or ones no recipe sets, keep working
    resolve(["fit", "--config", str(demo), "--data.batch_size", "8"], demo)
    resolve(["fit", "--trainer.default_root_dir", "x", "--config", str(demo)], demo)


def test_a_command_line_splits_into_subcommand_recipes_and_flags():
    command = split_command_line(["test", "--config", "a.yaml", "--data.batch_size=8", "--ckpt_path", "x.ckpt",
                                  "-c", "b.yaml", "--print_config", "--trainer.callbacks+", "m.C", "--model.lr", "-1",
                                  "--splits", "train", "val"])
    assert command.subcommand == "test" and command.recipes == ("a.yaml", "b.yaml")
    assert command.ckpt_path == "x.ckpt" and command.print_config
    assert [(flag.name, flag.values, flag.recipes_before) for flag in command.flags] == [
        ("data.batch_size", ("8",), 1), ("ckpt_path", ("x.ckpt",), 1), ("print_config", (), 2),
        ("trainer.callbacks+", ("m.C",), 2), ("model.lr", ("-1",), 2), ("splits", ("train", "val"), 2)]
    assert command.flags[3].key == "trainer.callbacks"
    # flags go on as typed
    assert command.tokens(without=["ckpt_path", "splits"]) == [
        "--data.batch_size=8", "--print_config", "--trainer.callbacks+", "m.C", "--model.lr", "-1"]
    # an option's value is never taken for the subcommand
    assert split_command_line(["--trainer.default_root_dir", "fit", "predict"]).subcommand == "predict"
    with pytest.raises(ValueError, match="unexpected argument 'fitt'"):
        split_command_line(["fitt", "--data.batch_size", "8"])


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
