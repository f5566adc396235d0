"""Upgrade guards: each private name layers/compat.py keeps, and each public LightningCLI hook the
suite overrides, still exists. An upgrade that removes or renames one fails here, by name, with
the installed version, instead of silently (an override nobody calls any more changes nothing)."""
from __future__ import annotations

import importlib
from importlib.metadata import version

import pytest

from layers.compat import PRIVATE_NAMES


@pytest.mark.parametrize("module, name, use", PRIVATE_NAMES, ids=[name for _, name, _ in PRIVATE_NAMES])
def test_private_name_kept_in_compat_still_exists(module, name, use):
    import inspect

    library = module.split(".")[0]
    found = importlib.import_module(module) if module != "torch.ops.aten" else __import__("torch").ops.aten
    *owners, last = name.split(".")
    for part in owners:
        found = getattr(found, part, None)
    if inspect.isclass(found) and not hasattr(found, last):  # an attribute each instance sets itself
        source = inspect.getsource(found)
        found = found if f"self.{last}" in source or f'getattr(self, "{last}"' in source else None
    else:
        found = getattr(found, last, None)
    assert found is not None, (f"{library} {version(library)}: {module}.{name} is gone; layers/compat.py uses it "
                               f"for {use}. Find its replacement and update layers/compat.py.")


#: public LightningCLI methods tasks/cli/suite.py overrides (before_fit, after_fit, ... are checked below)
CLI_HOOKS = ["parse_arguments", "add_arguments_to_parser", "before_instantiate_classes", "instantiate_trainer",
             "after_instantiate_classes"]


@pytest.mark.parametrize("hook", CLI_HOOKS)
def test_lightning_cli_still_has_the_hooks_the_suite_overrides(hook):
    import inspect

    from lightning.pytorch.cli import LightningCLI

    assert callable(getattr(LightningCLI, hook, None)), (
        f"lightning {version('lightning')}: LightningCLI.{hook} is gone; tasks/cli/suite.py.SuiteCLI overrides it")
    source = inspect.getsource(LightningCLI)
    assert f"self.{hook}(" in source, (
        f"lightning {version('lightning')}: LightningCLI no longer calls self.{hook}(); SuiteCLI's override "
        "would be silently skipped")


def test_lightning_cli_runs_before_and_after_subcommand_hooks():
    import inspect

    from lightning.pytorch.cli import LightningCLI

    source = inspect.getsource(LightningCLI)
    assert 'f"before_{subcommand}"' in source and 'f"after_{subcommand}"' in source, (
        f"lightning {version('lightning')}: LightningCLI no longer calls before_<subcommand>/after_<subcommand> "
        "(SuiteCLI.before_fit takes the run lock, after_fit releases it)")


def test_lightning_cli_takes_the_constructor_arguments_the_suite_passes():
    import inspect

    from lightning.pytorch.cli import LightningCLI

    params = inspect.signature(LightningCLI.__init__).parameters
    for name in ("save_config_callback", "save_config_kwargs", "seed_everything_default", "parser_kwargs",
                 "subclass_mode_data", "auto_configure_optimizers", "args", "run"):
        assert name in params, f"lightning {version('lightning')}: LightningCLI(..., {name}=) is gone (tasks/cli/suite.py)"


def test_precision_plugin_clips_by_norm_and_value():
    from lightning.pytorch.plugins.precision import MixedPrecision

    for name in ("clip_grad_by_norm", "clip_grad_by_value"):
        assert callable(getattr(MixedPrecision, name, None)), (
            f"lightning {version('lightning')}: Precision.{name} is gone (tasks/engine/base.py configure_gradient_clipping)")
