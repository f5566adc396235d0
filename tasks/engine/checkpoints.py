"""The suite's checkpoint files: reading and checking them, and writing ``last.ckpt``.

- :func:`read_checkpoint` / :func:`check_checkpoint_file` load a ``.ckpt`` weights-only, or refuse
  a missing, truncated, foreign or other task's file naming it, before Lightning fails without
  the path.
- :func:`rng_states` / :func:`set_rng_states`: the global RNG states every checkpoint carries, so a
  resumed run replays dropout and augmentation draws exactly; :func:`qualified_name` names the task class.
- :class:`LatestCheckpoint` writes ``last.ckpt`` on its own schedule, beside the ModelCheckpoint
  that keeps the best checkpoints on the task's metric (see :mod:`tasks.engine.cli`), and refuses a fit
  that would overwrite the ``last.ckpt`` of an earlier fit in its run root without resuming it.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint


#: the latest state of a fit, in the run root's checkpoint directory (``--ckpt_path last``)
LAST_NAME = "last.ckpt"


def read_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint's contents (weights-only) or refuse a missing, truncated or foreign file
    naming it, before Lightning's own loading fails without the path."""
    import torch

    file = Path(path)
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



class LatestCheckpoint(Checkpoint):
    """Writes ``dirpath/last.ckpt`` with the latest training state, whatever the metric.

    Written every ``every_n_train_steps`` optimizer steps (``0``: never mid-epoch; a step that a
    validation or the epoch's end follows is written after them instead), at every
    validation end and at every training epoch end, whether or not validation ran: a run killed
    before its first validation (a whole epoch, or three in a recipe validating every third)
    can still be resumed exactly. A step is written once. The best checkpoints are a plain
    ``ModelCheckpoint``'s (:mod:`tasks.engine.cli`); Lightning runs checkpoint callbacks after all
    others, so the file holds every callback's state of the step.

    Args:
        dirpath: the directory of ``last.ckpt`` (the CLI's ``<trainer.default_root_dir>/checkpoints``).
        every_n_train_steps: write it every this many optimizer steps too.
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 0):
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = int(every_n_train_steps or 0)
        self._saved_step = -1
        self._root_checked = False

    @property
    def path(self) -> Path:
        return self.dirpath / LAST_NAME

    @property
    def last_model_path(self) -> str:
        """The path of ``last.ckpt`` once written (``""`` before), as ``ModelCheckpoint`` names it."""
        return str(self.path) if self.path.is_file() else ""

    def save(self, trainer: Trainer) -> Path | None:
        """Write ``last.ckpt`` for the current step unless it holds it already; on every rank
        (``trainer.save_checkpoint`` is collective, rank 0 writes). ``None`` outside a fit."""
        if trainer.sanity_checking or trainer.state.fn != "fit" or trainer.fast_dev_run:
            return None
        if self._saved_step != trainer.global_step:
            trainer.save_checkpoint(self.path)
            self._saved_step = trainer.global_step
        return self.path

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._root_checked = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # strategies that restore after setup (FSDP, DeepSpeed) have not named the resumed checkpoint yet
        if not trainer.strategy.restore_checkpoint_after_setup:
            self.refuse_overwriting_another_fit(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.refuse_overwriting_another_fit(trainer)

    def refuse_overwriting_another_fit(self, trainer: Trainer) -> None:
        """Stop a fit that would overwrite the ``last.ckpt`` of an earlier fit in the same run root.

        A fit that resumes (``--ckpt_path``) continues that run, and one whose own callback wrote the file
        (a second ``trainer.fit`` in one process) goes on; any other would replace the earlier run's
        latest state, its only way to resume, and mix its checkpoints with the new run's. Rank 0's
        view decides for every rank, so all stop together."""
        if self._root_checked:
            return
        self._root_checked = True
        if trainer.ckpt_path is not None or trainer.fast_dev_run or self._saved_step >= 0:
            return
        if not trainer.strategy.broadcast(self.path.is_file(), src=0):
            return
        raise FileExistsError(
            f"{self.path} holds the last checkpoint of an earlier fit in this run root{describe_checkpoint(self.path)};"
            f" this fit would overwrite it. To continue that run, add --ckpt_path last; to start a new one, give it "
            f"its own --trainer.default_root_dir (or delete {self.dirpath} to start over in this one).")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if (self.every_n_train_steps > 0 and trainer.global_step % self.every_n_train_steps == 0
                and not validation_or_epoch_end_follows(trainer, batch_idx)):  # written after it instead
            self.save(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.save(trainer)


def describe_checkpoint(path: Path) -> str:
    """`` (epoch E, global step S, written <time>)`` of a checkpoint file, as far as it can be read."""
    import time

    import torch

    written = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return f" (epoch {saved['epoch']}, global step {saved['global_step']}, written {written})"
    except Exception:  # unreadable or foreign: its time still tells which run it is
        return f" (written {written})"


def validation_or_epoch_end_follows(trainer: Trainer, batch_idx: int) -> bool:
    """Whether the batch ``batch_idx`` just trained is the epoch's last or one that a validation follows.

    A checkpoint written there would resume past that validation: Lightning takes a checkpoint
    written after a batch's end for one written after the validation that follows, skips it, and
    the resumed run misses that validation's metrics and, since evaluation draws from the global
    RNG (a loader's base seed), trains on with other random numbers than the uninterrupted run.
    So ``last.ckpt`` and a stop signal wait for the validation (``on_validation_end``) or the epoch's end.
    """
    if batch_idx + 1 >= trainer.num_training_batches:
        return True
    every = trainer.val_check_batch
    return isinstance(every, int) and every > 0 and (batch_idx + 1) % every == 0 and any(n > 0 for n in trainer.num_val_batches)


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
    """``tasks.detect.DetectionTask``, also when the module runs as ``python -m tasks.detect``."""
    module = cls.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    return f"{module}.{cls.__qualname__}"
