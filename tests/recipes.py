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
