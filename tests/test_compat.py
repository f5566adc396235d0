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


def test_is_batchnorm_names_the_layers_that_use_batch_statistics():
    import torch.nn as nn

    from layers.compat import is_batchnorm

    batch_norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm2d()]
    others = [nn.InstanceNorm2d(2), nn.GroupNorm(1, 2), nn.LayerNorm(2), nn.Identity()]
    assert all(is_batchnorm(m) for m in batch_norms) and not any(is_batchnorm(m) for m in others), (
        f"torch {version('torch')}: torch.nn.modules.batchnorm._BatchNorm no longer is the base of the batch norms")


def test_torchmetrics_syncs_through_the_method_gathers_own_states_overrides():
    import inspect

    import torch
    from torchmetrics import Metric

    from layers.compat import GathersOwnStates

    assert "self._sync_dist(" in inspect.getsource(Metric.sync), (
        f"torchmetrics {version('torchmetrics')}: Metric.sync no longer calls _sync_dist; the COCO and VOC mAP "
        "metrics' own gathering (layers.compat.GathersOwnStates) would be skipped")

    class Counted(GathersOwnStates, Metric):
        def __init__(self):
            super().__init__(distributed_available_fn=lambda: True)  # as if under DDP: compute() syncs
            self.add_state("seen", default=[], dist_reduce_fx=None)
            self.groups = []

        def update(self, value):
            self.seen.append(value)

        def sync_states(self, group):
            self.groups.append(group)
            self.seen = self.seen + [torch.tensor(-1.0)]  # what another rank would add

        def compute(self):
            return torch.stack(self.seen)

    metric = Counted()
    metric.update(torch.tensor(1.0))
    assert metric.compute().tolist() == [1.0, -1.0] and metric.groups == [None]
    assert [t.item() for t in metric.seen] == [1.0]  # restored after compute(), as torchmetrics does
