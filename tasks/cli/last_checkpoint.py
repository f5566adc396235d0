"""``last.ckpt``: the latest training state, written on the run's own schedule beside the ModelCheckpoint
that keeps the best checkpoints on the task's metric (:mod:`tasks.cli.suite`); a fit that would overwrite
the ``last.ckpt`` of an earlier fit in its run root without resuming it is refused."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

#: the latest state of a fit, in the run root's checkpoint directory (``--ckpt_path last``)
LAST_NAME = "last.ckpt"


class LatestCheckpoint(Checkpoint):
    """Writes ``dirpath/last.ckpt`` with the latest training state, whatever the metric.

    The file also keeps the metrics the last validation logged, which Lightning does not checkpoint: a resumed
    run has them back in ``trainer.callback_metrics`` before its first step, so a ``ModelCheckpoint`` saving
    every ``n`` steps scores the steps before the next validation as the uninterrupted run did (without them
    it skipped them, and the resumed run kept other best checkpoints). Training's metrics are not kept: those
    logged per epoch are a mean over the steps a process ran, which no checkpoint can give back mid-epoch.

    Written every ``every_n_train_steps`` optimizer steps (``0``: never mid-epoch; a step that a
    validation or the epoch's end follows is written after them instead), at every
    validation end and at every training epoch end, whether or not validation ran: a run killed
    before its first validation (a whole epoch, or three in a recipe validating every third)
    can still be resumed exactly. A step is written once (the last epoch's end again: the finished
    state). The best checkpoints are a plain
    ``ModelCheckpoint``'s (:mod:`tasks.cli.suite`); Lightning runs checkpoint callbacks after all
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
        self._before_validation: dict | None = None  # callback_metrics as a validation started
        self._validation_metrics: dict = {}
        self._restored = False

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
        self._keep_validation_metrics(trainer)  # a stop signal saves from its own on_validation_end, before ours
        if self._saved_step != trainer.global_step:
            trainer.save_checkpoint(self.path)
            self._saved_step = trainer.global_step
        return self.path

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._root_checked = False

    def state_dict(self) -> dict:
        return {"validation_metrics": self._validation_metrics}

    def load_state_dict(self, state_dict: dict) -> None:
        self._validation_metrics = dict(state_dict.get("validation_metrics", {}))
        self._restored = True

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # strategies that restore after setup (FSDP, DeepSpeed) have not named the resumed checkpoint yet
        if not trainer.strategy.restore_checkpoint_after_setup:
            self.refuse_overwriting_another_fit(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.refuse_overwriting_another_fit(trainer)
        if self._restored:  # the resumed run's last validation, as it was when the file was written
            self._restored = False
            for name, value in self._validation_metrics.items():
                trainer.callback_metrics.setdefault(name, value)

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

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_validation = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._keep_validation_metrics(trainer)
        self.save(trainer)

    def _keep_validation_metrics(self, trainer: Trainer) -> None:
        # what the validation that just ended logged: the values it put in, new objects
        if self._before_validation is not None and not trainer.sanity_checking:
            self._validation_metrics = {name: value.detach().cpu() for name, value in trainer.callback_metrics.items()
                                        if hasattr(value, "detach") and self._before_validation.get(name) is not value}
        self._before_validation = None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if fit_ends_with_this_epoch(trainer):
            # the finished state, written again if its last validation wrote this step: that file's loops put the
            # run before its last epoch's end, so `fit --ckpt_path last` of a finished run (or a resume after a
            # kill past that write) ran the epoch's end again and rewrote last.ckpt with its counters advanced
            self._saved_step = -1
        self.save(trainer)


def fit_ends_with_this_epoch(trainer: Trainer) -> bool:
    """In ``on_train_epoch_end``: whether the fit stops after this epoch (``max_epochs`` reached; Lightning has
    counted the epoch as processed by then, and its fit loop stops on that count)."""
    max_epochs = trainer.max_epochs
    return max_epochs is not None and max_epochs >= 0 and \
        trainer.fit_loop.epoch_progress.current.processed >= max_epochs


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
