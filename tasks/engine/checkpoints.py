"""What a checkpoint file of this suite holds and how it is read.

- :func:`read_checkpoint` / :func:`check_checkpoint_file` load a ``.ckpt`` weights-only, or refuse
  a missing, truncated, foreign or other task's file naming it, before Lightning fails without
  the path.
- :func:`rng_states` / :func:`set_rng_states`: the global RNG states every checkpoint carries, so a
  resumed run replays dropout and augmentation draws exactly; :func:`qualified_name` names the task class.
- :func:`plain`: saved constructor arguments as plain dicts and lists (what a weights-only file can hold).

Writing ``last.ckpt`` on the run's schedule is the command's (:mod:`tasks.cli.last_checkpoint`).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch


def read_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint's contents (weights-only) or refuse a missing, truncated or foreign file
    naming it, before Lightning's own loading fails without the path."""
    import torch

    file = Path(path)
    if file.is_dir():
        raise ValueError(
            f"checkpoint {file} is a folder: a sharded checkpoint, one part per rank (Lightning's FSDPStrategy with "
            "state_dict_type='sharded', or ModelParallelStrategy). The suite reads one-file checkpoints, which "
            "--trainer.strategy fsdp writes; join an FSDPStrategy folder into one file with "
            f"`python -m lightning.pytorch.utilities.consolidate_checkpoint {file}`.")
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {file} does not exist")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {file} ({file.stat().st_size} bytes): {err}. "
                         "Is it truncated (an interrupted copy or download), or not a checkpoint at all?") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "pytorch-lightning_version" not in checkpoint:
        keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{file} is not a Lightning checkpoint of this suite (top-level keys: {keys}). "
                         "To start from foreign weights (timm, CVNets), use the backbone's `pretrained` "
                         "argument or the classification task's `weights`.")
    return checkpoint


def check_checkpoint_file(path: str, model_class: type | None = None) -> dict:
    """:func:`read_checkpoint`, and refuse a checkpoint of another task, naming both."""
    checkpoint = read_checkpoint(path)
    saved = checkpoint.get("suite_task")
    if model_class is not None:
        expected = qualified_name(model_class)
        if saved is not None and saved != expected:
            raise ValueError(f"{path} is a checkpoint of {saved}, not of {expected}: "
                             f"use it with `python -m {saved.rsplit('.', 1)[0]}`")
    return checkpoint



def rng_states() -> dict[str, Any]:
    """Global RNG states of torch (CPU and CUDA), numpy and Python as tensors and plain
    values, so a checkpoint holding them still loads with ``weights_only=True``."""
    state, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [state, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": [version, list(internal), gauss],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    state, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((state, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


def qualified_name(cls: type) -> str:
    """``tasks.detect.DetectionTask``, also when the module runs as ``python -m tasks.detect`` and when FSDP2
    has sharded the task (``fully_shard`` gives the instance a subclass, ``FSDPDetectionTask``)."""
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        cls = next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))
    module = cls.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    return f"{module}.{cls.__qualname__}"


def plain(value: Any) -> Any:
    """A config value (jsonargparse Namespaces, tuples) as plain dicts and lists."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    # a class or callable given in Python: its name (a checkpoint holds plain values only)
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"


def without_start_weights(hparams: dict[str, Any]) -> dict[str, Any]:
    """Saved constructor arguments without the weights training started from (``weights``, the backbone's
    ``pretrained``): the checkpoint's own weights replace them, so rebuilding it (``--ckpt_path``,
    ``tasks.load``) needs no start file, which the machine that evaluates may not have."""
    hparams = dict(hparams)
    if hparams.get("weights") is not None:
        hparams["weights"] = None
    backbone = hparams.get("backbone")
    init_args = backbone.get("init_args") if isinstance(backbone, dict) else None
    if isinstance(init_args, dict) and init_args.get("pretrained") is not None:
        hparams["backbone"] = {**backbone, "init_args": {**init_args, "pretrained": None}}
    return hparams
