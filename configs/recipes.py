"""A task's command line and its recipes, resolved into one config.

``split_command_line`` reads a command line, ``[subcommand] [--config RECIPE]... [--name value]...``,
into its parts; every command of the suite reads its arguments with it. ``resolve_recipes`` merges the
recipes into one config (a plain dict) that LightningCLI receives as a single ``--config``, with the
flags after it.

- A recipe may name the recipe it overrides with a top-level ``base:`` (a path relative to itself);
  ``base: null`` marks a complete recipe. A first ``--config`` without ``base`` is an overlay on the
  task's default recipe, so ``--config my_changes.yaml`` changes only what it lists; with no
  ``--config`` the default recipe is the config. Later ``--config`` files stack on what comes before.
- Layers merge as jsonargparse merges config files (:func:`merge`): a node that names another
  ``class_path`` replaces the node before it, arguments included; a node that gives arguments only
  (under ``init_args`` or beside its ``class_path``) merges into the class before it; lists replace.
- Flags apply after every recipe. LightningCLI would apply them in the order given, so a flag before
  a ``--config`` whose layers set the same key would lose to the recipe without a word: that is refused,
  naming the flag and the recipe.

Nothing here builds a parser or imports Lightning: any tool can resolve a recipe as the CLI does.
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import yaml

import configs

#: the LightningCLI subcommands
SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: the resolved config a run saves beside its logs (wandb keeps "config.yaml" for itself)
CONFIG_FILE_NAME = "suite_config.yaml"
#: the subcommand answered before LightningCLI parses (:mod:`tasks.export.command`)
EXPORT = "export"
#: options that never take the next argument as their value (``--print_config=skip_null`` gives one inline)
SWITCHES = ("--print_config", "--help", "-h")
CONFIG_OPTIONS = ("--config", "-c")
#: the keys of a class node (jsonargparse's subclass specification)
CLASS_KEYS = ("class_path", "init_args", "dict_kwargs")


# -- the command line --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One option of a command line as typed: ``--data.batch_size 8`` or ``--data.batch_size=8``."""

    name: str                 # without its dashes: "data.batch_size", "trainer.callbacks+"
    values: tuple[str, ...]   # () for a switch (``--print_config``); several for ``--splits train val``
    tokens: tuple[str, ...]   # the arguments it was typed as
    recipes_before: int       # how many ``--config`` came before it

    @property
    def value(self) -> str | None:
        return self.values[0] if self.values else None

    @property
    def key(self) -> str:
        """The config key it sets, without ``init_args`` levels (:func:`config_key`)."""
        return config_key(self.name.removesuffix("+"))


@dataclass(frozen=True)
class CommandLine:
    """A command line split into its subcommand, its recipes (the ``--config`` values, in order) and its flags."""

    subcommand: str | None
    recipes: tuple[str | dict, ...]  # a file, YAML text, or (from Python: ``tasks.run``) a dict
    flags: tuple[Flag, ...]

    def value(self, name: str) -> str | None:
        """The value of option ``name`` (``"ckpt_path"``); the last one given wins, as in argparse."""
        found = [flag.value for flag in self.flags if flag.name == name]
        return found[-1] if found else None

    def has(self, name: str) -> bool:
        return any(flag.name == name for flag in self.flags)

    @property
    def ckpt_path(self) -> str | None:
        return self.value("ckpt_path")

    @property
    def print_config(self) -> bool:
        return self.has("print_config")

    def tokens(self, without: Iterable[str] = ()) -> list[str]:
        """The flags as typed, in order, leaving out those named in ``without``."""
        left_out = set(without)
        return [token for flag in self.flags if flag.name not in left_out for token in flag.tokens]

    def argv(self) -> list[str]:
        """The command line again, recipes where they stood among the flags (a dict recipe as YAML text)."""
        args = [self.subcommand] if self.subcommand else []
        recipes = [r if isinstance(r, str) else yaml.safe_dump(r, sort_keys=False) for r in self.recipes]
        placed = 0
        for flag in self.flags:
            for recipe in recipes[placed:flag.recipes_before]:
                args += ["--config", recipe]
            placed = max(placed, flag.recipes_before)
            args += flag.tokens
        for recipe in recipes[placed:]:
            args += ["--config", recipe]
        return args


def split_command_line(argv: Sequence[str]) -> CommandLine:
    """Split ``argv`` into a :class:`CommandLine`.

    An option takes its value inline (``--name=value``) or from the next argument unless that starts with
    ``--`` (then it is a switch, and the parser it is handed to says whether that is allowed); further
    arguments that are no option belong to the option before them (``--splits train val``). The
    subcommand is the first argument that is neither an option nor an option's value."""
    subcommand, recipes, flags = None, [], []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "-":
            if subcommand is None and arg in (*SUBCOMMANDS, EXPORT):
                subcommand = arg
            elif flags:  # one more value of the option before it
                last = flags[-1]
                flags[-1] = Flag(last.name, (*last.values, arg), (*last.tokens, arg), last.recipes_before)
            else:
                raise ValueError(f"unexpected argument {arg!r}: a subcommand ({', '.join((*SUBCOMMANDS, EXPORT))}) "
                                 "or an option (--name value) was expected")
            i += 1
            continue
        name, equals, inline = arg.partition("=")
        if equals:
            values, tokens = (inline,), (arg,)
        elif name in SWITCHES or i + 1 >= len(args) or args[i + 1].startswith("--"):
            values, tokens = (), (arg,)
        else:
            values, tokens = (args[i + 1],), (arg, args[i + 1])
            i += 1
        i += 1
        if name in CONFIG_OPTIONS:
            if not values:
                raise ValueError(f"{arg} needs a recipe: --config PATH")
            recipes.append(values[0])
        else:
            flags.append(Flag(name.lstrip("-"), values, tokens, len(recipes)))
    return CommandLine(subcommand, tuple(recipes), tuple(flags))


# -- recipes -----------------------------------------------------------------------------------------------------
def recipe_path(task: str, name: str) -> Path:
    """Path of a shipped recipe, e.g. ``recipe_path("classify", "demo_mobilevitv2.yaml")``."""
    return Path(configs.__file__).parent / task / name


def read_recipe(source: str | Path | dict) -> tuple[dict, Path | None]:
    """``(content, file)`` of a recipe given as a file, as YAML text or as a dict (``file`` is ``None``
    for the last two, whose ``base`` is relative to the working directory)."""
    if isinstance(source, dict):
        return copy.deepcopy(source), None
    path = Path(source)
    try:
        is_file = path.is_file()
    except OSError:  # YAML text too long for a file name
        is_file = False
    try:
        content = yaml.safe_load(path.read_text() if is_file else str(source))
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {source} is not valid YAML: {err}") from None
    if content is None and is_file:
        content = {}
    if not isinstance(content, dict):
        what = "does not hold a mapping of settings" if is_file else "does not exist"
        raise FileNotFoundError(f"recipe {source} {what}: --config takes a YAML file (or YAML text of settings)")
    return content, (path if is_file else None)


def recipe_layers(source: str | Path | dict, default: Path | None,
                  seen: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """The layers a recipe stands for, ``[(name, settings), ...]``, bottom first: its ``base:`` chain, then
    itself, without the ``base`` keys. ``default`` goes under a recipe that names no base (``None``: nothing)."""
    content, path = read_recipe(source)
    name = str(path) if path is not None else "the given settings"
    if "base" not in content:
        is_default = default is not None and path is not None and path.resolve() == Path(default).resolve()
        under = [] if default is None or is_default else recipe_layers(default, None)
        return under + [(name, content)]
    here = path.resolve() if path is not None else None
    if here is not None and here in seen:
        raise ValueError(f"recipe {path} is its own base (base chain: {' -> '.join(map(str, seen))})")
    base = content.pop("base")
    if base is None:
        return [(name, content)]
    base_path = ((path.parent if path is not None else Path.cwd()) / str(base)).resolve()
    if not base_path.is_file():
        raise FileNotFoundError(f"recipe {name} names base: {base}, but {base_path} does not exist")
    return recipe_layers(base_path, default, seen + ((here,) if here is not None else ())) + [(name, content)]


def resolve_recipes(command: CommandLine, default: Path | None) -> dict:
    """The config the command line's recipes stack to (without its flags), with the default recipe where
    it applies: alone when a subcommand is given without ``--config``, under a first recipe without
    ``base``. Refuses a flag given before a recipe that sets its key (see the module's docstring)."""
    if not command.recipes:
        return stack(recipe_layers(default, None)) if command.subcommand and default is not None else {}
    config: dict = {}
    for index, recipe in enumerate(command.recipes):
        layers = recipe_layers(recipe, default if index == 0 else None)
        refuse_flags_before(command, index, layers, recipe)
        config = stack([("", config), *layers])
    return config


def stack(layers: Sequence[tuple[str, dict]]) -> dict:
    """The layers merged bottom to top (:func:`merge`)."""
    config: dict = {}
    for _, layer in layers:
        config = merge(config, layer)
    return config


def refuse_flags_before(command: CommandLine, index: int, layers: list[tuple[str, dict]], recipe: str) -> None:
    """Refuse a flag given before the ``index``-th recipe whose layers set its key or one above it."""
    earlier = [flag for flag in command.flags if flag.recipes_before <= index and flag.name != "print_config"]
    if not earlier:
        return
    keys = set().union(*(recipe_keys(layer) for _, layer in layers))
    for flag in earlier:
        parts = flag.key.split(".")
        if any(".".join(parts[:n]) in keys for n in range(1, len(parts) + 1)):
            raise ValueError(
                f"--{flag.name} comes before --config {recipe}, which sets {flag.key} too (itself or the recipes it "
                "stacks on): arguments apply in order, so the recipe's value would silently win. Put the flag after "
                "the --config.")


# -- merging -----------------------------------------------------------------------------------------------------
def merge(base, layer):
    """``layer`` over ``base``, as jsonargparse stacks config files: mappings merge key by key; in a class
    node (one with a ``class_path`` on either side) a ``class_path`` naming another class replaces the node
    with ``layer``'s, while arguments alone merge into the class's arguments; anything else, lists included,
    is replaced by ``layer``'s value."""
    if not (isinstance(base, dict) and isinstance(layer, dict)):
        return copy.deepcopy(layer)
    if "class_path" in base or "class_path" in layer:
        return merge_class_node(base, layer)
    merged = dict(base)
    for key, value in layer.items():
        merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
    return merged


def merge_class_node(base: dict, layer: dict) -> dict:
    base_class, layer_class = base.get("class_path"), layer.get("class_path")
    if base_class is not None and layer_class is not None and not same_class(base_class, layer_class):
        return copy.deepcopy(layer)
    merged = {"class_path": layer_class or base_class, "init_args": merge(class_arguments(base), class_arguments(layer))}
    extra = merge(base.get("dict_kwargs") or {}, layer.get("dict_kwargs") or {})
    return {**merged, "dict_kwargs": extra} if extra else merged


def class_arguments(node: dict) -> dict:
    """A class node's arguments: its ``init_args`` and any given beside its ``class_path``."""
    return {**{k: v for k, v in node.items() if k not in CLASS_KEYS}, **(node.get("init_args") or {})}


def same_class(one: str, other: str) -> bool:
    """Whether two class paths name one class (``backbones.MobileViTv2`` is ``backbones.mobilevitv2.MobileViTv2``)."""
    return one == other or _imported(one) is not None and _imported(one) is _imported(other)


def _imported(class_path: str):
    try:
        return import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return None


def import_class(class_path: str):
    """The class (or any attribute) a dotted path names: ``tasks.classify.ClassificationTask``."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# -- keys --------------------------------------------------------------------------------------------------------
def config_key(dotted: str) -> str:
    """A config key without ``init_args`` levels: ``data.init_args.batch_size`` -> ``data.batch_size``."""
    return ".".join(part for part in dotted.split(".") if part not in ("init_args", "dict_kwargs"))


def recipe_keys(config: dict) -> set[str]:
    """The keys (see :func:`config_key`) a config sets, down to its leaves."""
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif prefix:
            keys.add(config_key(prefix))

    walk(config, "")
    return keys
