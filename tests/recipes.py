"""Resolving a shipped recipe exactly as its task's CLI would, for the fidelity tests.

``resolve(task, recipe)`` runs ``python -m tasks.<task> fit --config <recipe> --print_config`` in
this process (base chains expanded by the CLI's own code) and returns the resolved config;
``value(config, "model.optimizer.init_args.lr")`` reads one dotted key, looking through
``init_args`` where LightningCLI nests class arguments, so reference tables can name keys the way
a recipe writes them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MISSING = object()


@functools.lru_cache(maxsize=None)
def _resolved_text(task: str, recipe: str) -> str:
    main = importlib.import_module(f"tasks.{task}").main
    out = io.StringIO()
    argv, sys.argv = sys.argv, sys.argv[:1]  # the test runner's own arguments are not the CLI's
    try:
        with contextlib.redirect_stdout(out):
            main(["fit", "--config", recipe, "--print_config"])
    except SystemExit as done:
        if done.code not in (0, None):
            raise AssertionError(f"{recipe} does not resolve (exit {done.code})") from None
    finally:
        sys.argv = argv
    return out.getvalue()


def resolve(task: str, recipe: str | Path) -> dict:
    """The whole resolved config of ``configs/<task>/<recipe>`` (or a path), a fresh copy each call."""
    path = Path(recipe)
    if not path.is_absolute():
        path = REPO / "configs" / task / path
    return yaml.safe_load(_resolved_text(task, str(path)))


def value(config: dict, dotted: str, default=MISSING):
    """``config["model"]["optimizer"]["init_args"]["lr"]`` for ``"model.optimizer.lr"`` or the full path.

    A part not found directly is looked up inside ``init_args``; a missing key raises ``KeyError``
    naming the dotted path, unless ``default`` is given.
    """
    node = config
    for part in dotted.split("."):
        if isinstance(node, list) and part.isdigit():
            node = node[int(part)]
            continue
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and isinstance(node.get("init_args"), dict) and part in node["init_args"]:
            node = node["init_args"][part]
        elif default is not MISSING:
            return default
        else:
            raise KeyError(f"{dotted}: no {part!r} in the resolved recipe")
    return node


def callback(config: dict, class_name: str) -> dict | None:
    """init_args of the trainer callback whose class_path ends with ``class_name`` (``None`` if absent)."""
    for entry in config["trainer"].get("callbacks") or []:
        if isinstance(entry, dict) and entry.get("class_path", "").endswith(class_name):
            return entry.get("init_args") or {}
    return None


def training_facts(config: dict) -> dict:
    """What a resolved recipe says about its optimisation, in the terms the fidelity tests' reference tables
    use (the same in every task): optimizer and its values, schedule, length, global batch, EMA, precision."""
    scheduler = value(config, "model.scheduler", None)
    trainer = config["trainer"]
    ema = callback(config, "EMAWeightAveraging")
    return {
        "optimizer": value(config, "model.optimizer.class_path"),
        "betas": value(config, "model.optimizer.betas", None),
        "momentum": value(config, "model.optimizer.momentum", None),
        "lr": value(config, "model.optimizer.lr"),
        "weight_decay": value(config, "model.optimizer.weight_decay"),
        "no_decay_on_norm_and_bias": value(config, "model.no_weight_decay_on_norm_bias"),
        "schedule": "fixed" if scheduler is None else {"tasks.engine.optim.WarmupCosineLR": "cosine"}.get(
            scheduler["class_path"], scheduler["class_path"]),
        "min_lr": value(scheduler, "min_lr") if scheduler else None,
        "warmup_steps": value(scheduler, "warmup_steps") if scheduler else 0,
        "warmup_init_lr": value(scheduler, "warmup_init_lr") if scheduler else None,
        "epochs": trainer["max_epochs"],
        "global_batch": value(config, "data.batch_size") * trainer["devices"] * (trainer.get("num_nodes") or 1)
        * (trainer.get("accumulate_grad_batches") or 1),
        "grad_clip": trainer.get("gradient_clip_val"),
        "mixed_precision": str(trainer["precision"]).endswith("-mixed"),
        "sync_batchnorm": bool(trainer.get("sync_batchnorm")),
        "channels_last": value(config, "model.channels_last"),
        "ema_decay": ema["decay"] if ema is not None else None,
    }


def checkpoint_stem(weights: str | None) -> str | None:
    """``mobilevitv2_100.cvnets_in1k`` (registered weights, read from ``checkpoints/imagenet1k_256/mobilevitv2-1.0.pt``)
    or that path -> ``imagenet1k_256/mobilevitv2-1.0``: what a start checkpoint was trained on (its folder) and for
    which width (its stem)."""
    if weights is None:
        return None
    from backbones.pretrained import weights_file

    folder, name = weights_file(weights).as_posix().rsplit("/", 2)[-2:]
    return f"{folder}/{name.rsplit('.', 1)[0]}"


def normalisation(config: dict) -> tuple[list[float], list[float]]:
    """The mean and std a resolved recipe's datamodule normalises with: ``data.mean`` / ``data.std`` where given,
    else those of the weights the model starts from (``model.weights``, else the backbone's ``pretrained``: what
    the CLI gives the datamodule as its ``weights``)."""
    from datamodules.input_spec import normalization

    weights = (value(config, "data.weights", None) or value(config, "model.weights", None)
               or value(config, "model.backbone.pretrained", None))
    mean, std = normalization(weights, value(config, "data.mean", None), value(config, "data.std", None))
    return list(mean), list(std)


def assert_fact(recipe: str, fact: str, got, expected, source: str) -> None:
    """``got`` equals the reference value (floats to 1e-9 relative), or fail naming the recipe, the value
    and the reference's source."""
    import pytest  # only the tests use this module; keep the resolver importable without pytest

    equal = got == pytest.approx(expected, rel=1e-9) if isinstance(expected, float) else got == expected
    assert equal, f"{recipe}: {fact} is {got!r}, {source} says {expected!r}"
