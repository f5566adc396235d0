"""Resuming ``fit`` refuses to drift, and one run root holds one running ``fit``.

:class:`ResumeGuard` records in every checkpoint the settings a resume must keep and, on
``fit --ckpt_path``, compares them with this launch's. Per setting:

- data order (``data.seed``, ``data.shuffle``): the resumed epoch is rebuilt from the seed and the
  batches already trained on are skipped; another order would see some samples twice and others
  never. Refused.
- global batch (``data.batch_size`` or translation's ``data.max_tokens``,
  ``trainer.accumulate_grad_batches``, ``world_size`` = devices x nodes): the schedule counts
  optimizer steps of another size, and Lightning counts the batches done in the epoch as batches of
  the new size. Refused. (The position in the epoch is stored in samples, :mod:`datamodules.resumable`, so the
  data itself goes on after the samples already trained on.)
- optimizer and schedule arguments (``model.optimizer``, ``model.scheduler``): the checkpoint's
  optimizer state (learning rate included) would silently win over the new values that
  ``suite_config.yaml`` records. Refused.

``--allow_changed KEY[,KEY...]`` accepts the named differences knowingly (a key covers the keys
under it: ``model.optimizer`` accepts any change of its arguments). Data-order and batch changes
then continue with a warning saying what the epoch's position means now; accepted optimizer or
schedule changes take effect from the first resumed step (the optimizer's moments are kept, its
learning rate, weight decay and the schedule's arguments are the new ones). Another optimizer
class is refused even so: its saved state belongs to the old one.

``seed_everything`` is not compared: a resume restores the RNG states from the checkpoint.

:class:`RunLock` is ``<trainer.default_root_dir>/fit.lock``: the pid, host and SLURM job of the
``fit`` using that run root. A second ``fit`` there refuses, naming them; the file is removed at
exit, and one left by a dead process on the same host (or by an earlier incarnation of the same
SLURM job, requeued onto another node) is taken over. A run root holds one run after the other too:
a later ``fit`` there without ``--ckpt_path`` is refused before it trains, as it would overwrite the
earlier run's ``last.ckpt`` (:class:`tasks.cli.last_checkpoint.LatestCheckpoint`); ``--ckpt_path last`` (the
pre-emption message's command, the requeue script's) continues that run. :func:`make_run_root`
creates the folder, naming a file that stands in its way.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from layers.errors import Refusal
from tasks.engine.checkpoints import plain
from tasks.engine.optim import schedule_arguments

DATA_ORDER = ("data.seed", "data.shuffle", "data.repeated_augmentation", "data.variable_resolution",
              "data.progressive_resizing")
GLOBAL_BATCH = ("data.batch_size", "data.max_tokens", "trainer.accumulate_grad_batches", "world_size")
OPTIMIZATION = ("model.optimizer", "model.scheduler")
#: the data arguments recorded (whichever the datamodule has)
DATA_KEYS = ("seed", "shuffle", "batch_size", "max_tokens", "repeated_augmentation", "variable_resolution",
             "progressive_resizing")
#: data arguments recorded only away from their default (a run without them, or a checkpoint written before
#: they existed, took the default's order)
RECORDED_WHEN_SET = {"repeated_augmentation": 1, "variable_resolution": None, "progressive_resizing": None}

CONSEQUENCE = {
    DATA_ORDER: "the rest of the epoch follows the new order: some of its samples are seen twice, others never",
    GLOBAL_BATCH: "the epoch's position is converted to samples: the resumed epoch goes on after the samples "
                  "already trained on (other max_tokens pack other batches: it skips as many sentences of the new "
                  "ones); Lightning still counts the batches done in this epoch as batches of the new size, so a "
                  "larger batch ends this epoch early, and the schedule's steps are of another size",
    OPTIMIZATION: "the new values replace the checkpoint's from the first resumed step; the optimizer's moments are kept",
}


def resume_settings(config) -> dict[str, Any]:
    """The settings of a ``fit`` config (one subcommand's namespace) that a resume must keep,
    by dotted key; ``world_size`` is added at run time by :class:`ResumeGuard`."""
    data = config.data
    data_args = data.get("init_args", data) if hasattr(data, "get") else {}
    settings = {f"data.{key}": plain(data_args.get(key)) for key in DATA_KEYS
                if key in data_args and data_args.get(key) != RECORDED_WHEN_SET.get(key, object())}
    settings["trainer.accumulate_grad_batches"] = config.trainer.accumulate_grad_batches
    for key in ("optimizer", "scheduler"):
        settings[f"model.{key}"] = plain(config.model.get(key))
    return settings


def flatten(settings: dict[str, Any]) -> dict[str, Any]:
    """``{"model.optimizer": {"init_args": {"lr": 1}}}`` -> ``{"model.optimizer.init_args.lr": 1}``."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flatten({f"{key}.{k}": v for k, v in value.items()}))
        else:
            out[key] = value
    return out


def category(key: str) -> tuple[str, ...]:
    return next(group for group in (DATA_ORDER, GLOBAL_BATCH, OPTIMIZATION)
                if any(key == k or key.startswith(k + ".") for k in group))


def parse_allowed(value: str | list[str] | None) -> list[str]:
    """``"data.batch_size, model.optimizer"`` (or a list) -> the keys."""
    if not value:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [key.strip() for item in items for key in str(item).split(",") if key.strip()]


class ResumeGuard(Callback):
    """Records the resume settings and the run's identity in every checkpoint; on ``fit
    --ckpt_path`` refuses differing settings unless ``allow_changed`` names them (see the module).

    Args:
        settings: this launch's :func:`resume_settings`.
        allow_changed: dotted keys whose differences are accepted.
    """

    def __init__(self, settings: dict[str, Any], allow_changed: list[str] | None = None):
        self.settings = dict(settings)
        self.allow_changed = list(allow_changed or [])
        #: one id per training run, kept across resumes: tells checkpoints of two runs apart
        self.run_id = uuid.uuid4().hex
        self._apply_new_optimization = False

    def current(self, trainer: Trainer) -> dict[str, Any]:
        return {**self.settings, "world_size": trainer.world_size}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        checkpoint["suite_resume"] = self.current(trainer)
        checkpoint["suite_run"] = {"id": self.run_id, "root": str(Path(trainer.default_root_dir).resolve())}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if trainer.state.fn != "fit":
            return
        self.run_id = checkpoint.get("suite_run", {}).get("id", self.run_id)
        saved = checkpoint.get("suite_resume")
        if saved is None:  # a checkpoint without recorded settings (not a suite fit's): nothing to compare
            return
        old, new = flatten(saved), flatten(self.current(trainer))
        changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        allowed = [k for k in changed if any(k == a or k.startswith(a + ".") for a in self.allow_changed)]
        refused = [k for k in changed if k not in allowed]
        class_changed = [k for k in changed if k.startswith(OPTIMIZATION) and k.endswith("class_path")
                         and old.get(k) is not None and new.get(k) is not None]
        where = f"checkpoint {trainer.ckpt_path}" if trainer.ckpt_path else "the checkpoint"
        if class_changed:
            raise ValueError(f"cannot resume {where} with another optimizer or schedule class ("
                             + "; ".join(f"{k}: {old[k]} -> {new[k]}" for k in class_changed)
                             + "): its saved state belongs to the old one. Resume with the old class, or start "
                             "a new fit from the weights.")
        if refused:
            lines = [f"  {k}: {_short(old.get(k))} -> {_short(new.get(k))}" for k in refused]
            raise ValueError(
                f"cannot resume {where}: this launch differs from the run it continues in\n" + "\n".join(lines)
                + "\nResume with the checkpoint's values, or accept the differences knowingly with "
                f"--allow_changed {','.join(refused)} ({'; '.join(sorted({CONSEQUENCE[category(k)] for k in refused}))}).")
        for key in allowed:
            rank_zero_warn(f"resuming with {key} changed ({_short(old.get(key))} -> {_short(new.get(key))}), "
                           f"accepted by --allow_changed: {CONSEQUENCE[category(key)]}")
        self._apply_new_optimization = any(category(k) == OPTIMIZATION for k in allowed)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the optimizer and schedule states were restored after on_load_checkpoint: overwrite
        # their arguments now, before the first resumed step
        if self._apply_new_optimization:
            apply_new_optimization(trainer, pl_module)
            self._apply_new_optimization = False


def apply_new_optimization(trainer: Trainer, pl_module: LightningModule) -> None:
    """Give the restored optimizer and schedule this launch's arguments: a fresh
    ``configure_optimizers()`` supplies the parameter-group values (learning rate, weight decay,
    betas, ...) and the schedule's arguments and base learning rates; the restored optimizer
    keeps its moments and the schedule its step count."""
    fresh = pl_module.configure_optimizers()
    restored = trainer.optimizers[0]
    for old_group, new_group in zip(restored.param_groups, fresh["optimizer"].param_groups):
        old_group.update({k: v for k, v in new_group.items() if k != "params"})
    new_schedule = fresh.get("lr_scheduler", {}).get("scheduler")
    if new_schedule is None or not trainer.lr_scheduler_configs:
        return
    schedule = trainer.lr_scheduler_configs[0].scheduler
    state = schedule.state_dict()
    arguments = schedule_arguments(new_schedule)
    if getattr(new_schedule, "total_steps", 0) is None:  # the run's length was filled in at its start: keep it
        arguments.pop("total_steps", None)
    schedule.load_state_dict({**state, **arguments})
    for group, lr in zip(restored.param_groups, schedule.get_lr()):
        group["lr"] = lr


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- one fit per run root ---------------------------------------------------------------------------
class RunInUse(Refusal, RuntimeError):
    """Another ``fit`` is using the run root (a refusal: the command line shows its message alone)."""


def check_run_root(root: str | Path) -> None:
    """Refuse a run root (``trainer.default_root_dir``) that cannot be one, before anything is built: a file
    in its place or in place of a folder above it, or a folder this process may not write in (the run root,
    or the nearest folder above it that exists), naming it and the key."""
    root = Path(root)
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise NotADirectoryError(
            f"trainer.default_root_dir={root} cannot be a run folder: {existing} is a file. The run root holds "
            "the checkpoints, logs and predictions; give --trainer.default_root_dir a folder path (it is created), "
            "or move the file away")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"trainer.default_root_dir={root}: this user cannot write in {existing} (read-only). The run writes its "
            "checkpoints, logs and predictions there; give --trainer.default_root_dir a folder you can write in")


def make_run_root(root: str | Path) -> Path:
    """Create the run root folder (``trainer.default_root_dir``) if needed; a file in its place, or in
    place of a folder above it, or a read-only folder, is an error naming it (:func:`check_run_root`)
    instead of ``mkdir``'s bare ``FileExistsError``."""
    check_run_root(root)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class RunLock:
    """``<root>/fit.lock``, held by one ``fit`` at a time (see the module)."""

    NAME = "fit.lock"

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.path = self.root / self.NAME
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "job": os.environ.get("SLURM_JOB_ID"),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        self.held = False

    def holder(self) -> dict | None:
        """The lock's content, or ``None`` when there is no lock or it is unreadable (half written)."""
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def stale(self, holder: dict | None) -> bool:
        if holder is None:
            return True
        same_host = holder.get("host") == self.me["host"]
        if same_host and (holder.get("pid") == self.me["pid"] or not _alive(int(holder.get("pid", -1)))):
            return True
        # a requeued SLURM job keeps its id; its earlier incarnation is gone, wherever it ran
        return self.me["job"] is not None and holder.get("job") == self.me["job"]

    def acquire(self) -> None:
        make_run_root(self.root)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:  # being written this instant, or left empty by a crash: look again
                    time.sleep(0.2)
                    holder = self.holder()
                if not self.stale(holder):
                    raise RunInUse(
                        f"{self.root} is in use by another fit: pid {holder.get('pid')} on host {holder.get('host')}"
                        f"{' (SLURM job ' + holder['job'] + ')' if holder.get('job') else ''}, started "
                        f"{holder.get('started')}: {holder.get('command')}\nWait for it to finish, give this run its "
                        f"own --trainer.default_root_dir, or, if that process is gone, delete {self.path}") from None
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)
            return
        raise RunInUse(f"could not take {self.path}: other processes keep taking it")

    def release(self) -> None:
        if not self.held:
            return
        holder = self.holder()
        if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)
        self.held = False
