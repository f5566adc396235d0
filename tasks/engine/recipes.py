"""Recipe stacking for the suite's CLI: which ``--config`` layers an argument list expands to.

A recipe may name the recipe it overrides with a top-level ``base:`` (a path relative to itself);
``base: null`` marks a complete recipe. :func:`with_default_config` expands an argument list
into the layers LightningCLI reads, in order; it reads YAML files and nothing else, so
:mod:`tasks.engine.cli` and any tool can use it without building a parser.
"""
from __future__ import annotations

from pathlib import Path

import yaml

import configs

#: the LightningCLI subcommands (``export`` is answered before LightningCLI parses)
SUBCOMMANDS = ("fit", "validate", "test", "predict")


def recipe_path(task: str, name: str) -> Path:
    """Path of a shipped recipe, e.g. ``recipe_path("classify", "demo_mobilevitv2.yaml")``."""
    return Path(configs.__file__).parent / task / name


def with_default_config(args: list[str], default: Path) -> list[str]:
    """Resolve recipe stacking in an argument list.

    - No ``--config``: the task's default (demo) recipe, inserted after the subcommand.
    - A recipe may name the recipe it overrides with a top-level ``base:`` (a path relative to
      itself); ``base: null`` marks a complete recipe. A first ``--config`` without ``base`` is an
      overlay on the task's default recipe, so ``--config my_changes.yaml`` changes only what it
      lists. Later ``--config`` files stack on what comes before them, as in LightningCLI.

    Each file with a ``base`` key is passed on as the YAML text of its other keys, after the
    files it stacks on; ``--print_config`` shows the result fully resolved.

    LightningCLI applies arguments in order, so a flag before a ``--config`` whose layers set the
    same key would be overridden without a word (the default recipe, inserted at the first
    ``--config`` overlay, included): that is refused, naming the flag and the recipe.
    """
    positions = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
    if not positions:
        for i, a in enumerate(args):
            if a in SUBCOMMANDS:
                layers = [flag for layer in recipe_layers(str(default), None) for flag in ("--config", layer)]
                return args[: i + 1] + layers + args[i + 1:]
        return args
    out, first, flags = [], True, {}
    for i, arg in enumerate(args):
        if i in positions and arg.startswith("--config="):
            value = arg.split("=", 1)[1]
        elif i in positions and i + 1 < len(args):
            value = args[i + 1]
        elif i - 1 in positions and args[i - 1] == "--config":
            continue  # the value, handled with its flag
        else:
            out.append(arg)
            if arg.startswith("--") and arg not in ("--print_config",):
                flags[config_key(arg[2:].split("=", 1)[0].removesuffix("+"))] = arg.split("=", 1)[0]
            continue
        layers = recipe_layers(value, default if first else None)
        check_not_overridden(flags, layers, value)
        for layer in layers:
            out += ["--config", layer]
        first = False
    return out


def config_key(dotted: str) -> str:
    """A config key without ``init_args`` levels: ``data.init_args.batch_size`` -> ``data.batch_size``."""
    return ".".join(part for part in dotted.split(".") if part not in ("init_args", "dict_kwargs"))


def recipe_keys(layer: str) -> set[str]:
    """The keys (see :func:`config_key`) a ``--config`` layer (a file or YAML text) sets."""
    try:
        is_file = Path(layer).suffix in (".yaml", ".yml") and Path(layer).is_file()
    except OSError:  # YAML text too long for a file name
        is_file = False
    try:
        content = yaml.safe_load(Path(layer).read_text() if is_file else layer)
    except (OSError, yaml.YAMLError):
        return set()
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif prefix:
            keys.add(config_key(prefix))

    walk(content, "")
    return keys


def check_not_overridden(flags: dict[str, str], layers: list[str], recipe: str) -> None:
    """Refuse flags given before a ``--config`` whose layers set the same key or one above it."""
    if not flags:
        return
    keys = set().union(*(recipe_keys(layer) for layer in layers))
    for key, flag in flags.items():
        parts = key.split(".")
        if any(".".join(parts[:n]) in keys for n in range(1, len(parts) + 1)):
            raise ValueError(
                f"{flag} comes before --config {recipe}, which sets {key} too (itself or the recipes it stacks on): "
                "arguments apply in order, so the recipe's value would silently win. Put the flag after the --config.")


def recipe_layers(value: str, default: Path | None, seen: tuple[Path, ...] = ()) -> list[str]:
    """The ``--config`` values a recipe expands to: its base chain, then itself (see :func:`with_default_config`).
    ``default`` is put under a recipe that names no base (``None``: stack on nothing)."""
    path = Path(value)
    try:
        is_recipe = path.suffix in (".yaml", ".yml") and path.is_file()
    except OSError:  # an expanded base chain handed to a DDP child: a YAML string too long for a file name
        is_recipe = False
    if not is_recipe:
        return [value]  # a YAML string or something LightningCLI reports itself
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(content, dict) or "base" not in content:
        # the default recipe may itself be an override: stack its whole chain
        under = [] if default is None or path.resolve() == Path(default).resolve() else recipe_layers(str(default), None)
        return under + [value]
    if path.resolve() in seen:
        raise ValueError(f"recipe {path} is its own base (base chain: {' -> '.join(map(str, seen))})")
    base = content.pop("base")
    layers = []
    if base is not None:
        base_path = (path.parent / str(base)).resolve()
        if not base_path.is_file():
            raise FileNotFoundError(f"recipe {path} names base: {base}, but {base_path} does not exist")
        layers = recipe_layers(str(base_path), default, seen + (path.resolve(),))
    return layers + ([yaml.safe_dump(content, sort_keys=False)] if content else [])


def given_keys(args: list[str]) -> set[str]:
    """The config keys (see :func:`config_key`) that an expanded argument list sets explicitly:
    its ``--flags`` and the keys of its ``--config`` layers (defaults of the classes excluded)."""
    keys: set[str] = set()
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            keys |= recipe_keys(args[i + 1])
        elif arg.startswith("--config="):
            keys |= recipe_keys(arg.split("=", 1)[1])
        elif arg.startswith("--") and not (i > 0 and args[i - 1] == "--config"):
            keys.add(config_key(arg[2:].split("=", 1)[0].removesuffix("+")))
    return keys
