"""The LightningCLI every task runs: ``python -m tasks.<task> {fit,validate,test,predict,export}``.

Defaults shared by all tasks (each overridable from YAML or the command line):
- the task's demo recipe when no ``--config`` is given;
- a WandbLogger (project ``suite-<task>``), offline unless an API key is configured, writing
  under ``trainer.default_root_dir``; fit, validate, test and predict runs of one model share a
  wandb group (carried by the checkpoint) with the subcommand as job type; the resolved config
  goes into the run as ``suite_config.yaml``;
- checkpoints (``--checkpoint.*``, ModelCheckpoint's arguments): a plain ModelCheckpoint keeps the
  best on the task's main metric, and :class:`tasks.cli.last_checkpoint.LatestCheckpoint` writes
  ``last.ckpt`` on its own schedule (every ``every_n_train_steps`` and every epoch end) whether or
  not the metric exists yet; ``--checkpoint.save_last false`` leaves it out;
- a per-step learning-rate monitor; a Rich progress bar on a terminal, plain progress lines
  (:class:`tasks.cli.progress.LineProgress`) when the output goes to a file;
- a fixed seed;
- freed CPU memory kept for reuse instead of unmapped (:mod:`tasks.cli.runtime`);
- torch threads and loader workers (``num_workers: auto``) from the cores each rank may use, stated at
  start-up (:mod:`layers.machine`);
- checkpoints written atomically beside their destination (:mod:`tasks.cli.checkpoint_io`);
- on ``fit``: SIGTERM / SIGUSR1 stop every rank at a step boundary with ``last.ckpt`` written and
  exit code ``128 + signal`` (:mod:`tasks.cli.preemption`; ``--preemption.signals`` names others);
  a resume whose data order, global batch, optimizer or schedule differ from the checkpoint's
  is refused unless ``--allow_changed`` names the differences, and a second ``fit`` in a run
  root in use is refused (:mod:`tasks.cli.resume`);
- a flag placed before a ``--config`` that sets the same key is refused (the recipe would win);
- a refusal (a bad file, key or value, a run root that is a file, read-only or in use by another fit,
  absent weights) prints ``error: <message> [raised at <file:line>; SUITE_DEBUG=1 shows the traceback]``
  and exits 1 (:mod:`layers.errors`); a bug keeps its traceback;
- `test` and `predict` replace an earlier run's outputs in their folder and mark it ``INCOMPLETE.txt``
  until the last file is written (:mod:`tasks.outputs.common`).

With ``--ckpt_path`` on ``validate``/``test``/``predict`` the checkpoint supplies the model:
its saved constructor arguments (backbone and head, class names, category ids, vocabulary)
rebuild it, and only ``--model.*`` arguments given on the command line override them.

A backbone with an ``img_size`` argument (ViT) takes ``--data.image_size``; an explicit
``--model.backbone.img_size`` that differs is refused.

The command line is split, and its recipes (``base:`` chains, the default recipe) and the checkpoint's
arguments are merged into one config, by :mod:`configs.recipes`; LightningCLI reads that config as
one ``--config``, then the command line's flags, which therefore win. Reading checkpoint files and
``last.ckpt`` is :mod:`tasks.engine.checkpoints`. Only public LightningCLI hooks are overridden
(``parse_arguments``, ``add_arguments_to_parser``, ``before_instantiate_classes``, ``instantiate_trainer``, ...).

``export --ckpt_path X`` writes the checkpoint's model as ONNX (see :mod:`tasks.export.command`); it
needs no Trainer, so it is answered before LightningCLI parses anything.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

import yaml
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor, ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from configs.recipes import EXPORT, CommandLine, import_class, merge, recipe_keys, resolve_recipes, split_command_line
from configs.tasks import TaskDeclaration, task_declaration
from layers.machine import AUTO, apply_cpu_plan, machine_cores, plan_cpu
from tasks.cli.checkpoint_io import AtomicCheckpointIO
from tasks.cli.determinism import check_deterministic
from layers.errors import refusals_as_messages
from tasks.cli.last_checkpoint import LAST_NAME, LatestCheckpoint
from tasks.cli.links import link_image_size, link_weights
from tasks.cli.loggers import (SaveConfigToRun, default_logger, link_wandb_runs, logger_summary,
                              route_loggers_to_run_root)
from tasks.cli.preemption import Preemption, RankEnded, launched_ranks_failed, resume_command
from tasks.cli.progress import LineProgress, RichProgress, stdout_is_terminal
from tasks.cli.resume import ResumeGuard, RunLock, check_run_root, parse_allowed, resume_settings
from tasks.cli.runtime import ThreadsFollowLoad, cuda_speed_settings, reuse_freed_memory
from tasks.cli.sharding import check_sharding, sharded_strategy
from tasks.cli.throughput import Throughput
from tasks.engine.checkpoints import check_checkpoint_file, plain, read_checkpoint

if TYPE_CHECKING:
    from tasks.export.onnx import ExportReport

EVALUATION = ("validate", "test", "predict")


def main(task: str, args: Sequence[str] | CommandLine | None = None, *, run: bool = True,
         exit_on_error: bool = True) -> "SuiteCLI | ExportReport":
    """``python -m tasks.<task> ...``: what the command built (the CLI, or the export's report).

    ``export`` needs no Trainer and is answered here, before any CLI exists; every other subcommand is a
    :class:`SuiteCLI`. ``args`` is the command line (``sys.argv[1:]`` when ``None``) or its split form, whose
    recipes may be dicts (``tasks.run``); ``exit_on_error=False`` raises a bad argument instead of exiting.

    Run as the process's command (``args`` is ``None``: ``python -m tasks.<task>``), a refusal (a bad file, key
    or value, a run root in use, absent weights) prints its message and exits 1, the traceback behind
    ``SUITE_DEBUG=1`` (:mod:`layers.errors`); a caller that passes ``args`` gets the exception."""
    if args is not None or not exit_on_error:
        return _command(task, args, run=run, exit_on_error=exit_on_error)
    with refusals_as_messages():
        return _command(task, args, run=run, exit_on_error=True)


def _command(task: str, args: Sequence[str] | CommandLine | None, *, run: bool,
             exit_on_error: bool) -> "SuiteCLI | ExportReport":
    declaration = task_declaration(task)
    command = args if isinstance(args, CommandLine) else split_command_line(sys.argv[1:] if args is None else args)
    if command.subcommand == EXPORT:
        from tasks.export.command import run_export

        return run_export(command, import_class(declaration.module), prog=f"python -m tasks.{task} {EXPORT}")
    return SuiteCLI(declaration, command, run=run, exit_on_error=exit_on_error)


class SuiteCLI(LightningCLI):
    """LightningCLI with the suite's defaults for the task ``declaration`` names (``configs/<task>/task.yaml``).
    The model's ``DATA_LINKS`` (datamodule attribute -> constructor argument) are linked on ``fit`` and on
    evaluations without a checkpoint; with a checkpoint they come from it, and the task checks them against
    the data it scores."""

    def __init__(self, declaration: TaskDeclaration | str, command: CommandLine | Sequence[str], *,
                 run: bool = True, exit_on_error: bool = True):
        reuse_freed_memory()
        declaration = task_declaration(declaration) if isinstance(declaration, str) else declaration
        command = command if isinstance(command, CommandLine) else split_command_line(command)
        if command.subcommand == EXPORT:
            raise ValueError(f"{EXPORT} builds no Trainer: run it through tasks.cli.suite.main")
        model_class = import_class(declaration.module)
        self.task = declaration.name
        self.declaration = declaration
        self.user_command = command  # as typed: for the resume command
        self.trainer = None
        self.checkpoint = read_checkpoint_for(command, model_class)
        config = resolve_recipes(command, declaration.demo_recipe_path)
        if self.checkpoint is not None:
            config = merge(config, {"model": checkpoint_arguments(self.checkpoint)})
        self.given_keys = recipe_keys(config) | {flag.key for flag in command.flags}
        # `--ckpt_path` is kept out of parsing (and set in before_instantiate_classes) where LightningCLI would
        # merge the checkpoint's arguments over the command line's: an evaluation whose checkpoint supplies the
        # model, and fit, which resumes the model the recipe and the flags describe (with the checkpoint's
        # arguments over them, the resume guard could not see, nor refuse, a changed optimizer). --print_config
        # exits while parsing, before that merge: there it stays, so the printout shows it.
        kept_out = (self.checkpoint is not None or command.subcommand == "fit") and not command.print_config
        self.checkpoint_path = _path_or_none(command.ckpt_path) if kept_out else None
        # the parser's one input is a command line: the merged config goes to it as one YAML text
        self.resolved_args = [*([command.subcommand] if command.subcommand else []),
                              *(["--config", yaml.safe_dump(config, sort_keys=False)] if config else []),
                              *command.tokens(without=["ckpt_path"] if kept_out else [])]
        self.links = {} if self.checkpoint is not None else dict(getattr(model_class, "DATA_LINKS", {}))
        self.wandb_group = None
        # any datamodule class can be chosen from YAML or `--data path.to.Class` (a dataset format is one
        # file); recipes that give only its arguments get the task's default format
        super().__init__(
            model_class,
            LightningDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveConfigToRun,
            save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
            seed_everything_default=0,
            auto_configure_optimizers=False,  # optimizer/scheduler are model arguments
            # export is answered by main(), before any parsing; `--help` names it here
            parser_kwargs={"epilog": f"{EXPORT}: export the checkpoint's model to ONNX and check it against PyTorch "
                                     f"with ONNX Runtime (python -m tasks.{self.task} {EXPORT} --help)",
                           **({} if exit_on_error else {"exit_on_error": False})},
            args=self.resolved_args,
            run=run,
        )

    def parse_arguments(self, parser, args) -> None:
        # `args` is the subcommand, the one resolved config and the flags (configs.recipes), built from
        # the command line: the one source of arguments, so LightningCLI's warning about sys.argv holding
        # arguments too does not apply. DDP's launcher restarts the script with sys.argv, which resolves to
        # the same arguments there.
        self.config = parser.parse_args(args)

    def add_arguments_to_parser(self, parser) -> None:
        # trainer defaults as plain config, so --print_config shows them and recipes override them
        parser.set_defaults({
            "trainer.default_root_dir": f"runs/{self.task}",
            "trainer.logger": default_logger(self.task),
            "trainer.callbacks": [
                {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                 "init_args": {"logging_interval": "step"}},
            ],
        })
        parser.set_defaults({"data": {"class_path": self.declaration.datamodule}})
        parser.add_argument(
            "--allow_changed", type=Optional[str], default=None,
            help="fit --ckpt_path: comma-separated settings (e.g. data.batch_size,model.optimizer) that may differ "
                 "from the checkpoint's; without it such a resume is refused (see tasks/cli/resume.py)")
        parser.add_argument(
            "--throughput", type=bool, default=True,
            help="fit: report samples/s, the loader's share of the step time and MFU (tasks/cli/throughput.py); "
                 "false leaves the callback out")
        parser.add_lightning_class_args(Preemption, "preemption")
        # ModelCheckpoint's arguments: the best checkpoints on the task's metric, and with save_last
        # (on by default) last.ckpt on its own schedule (tasks.cli.last_checkpoint.LatestCheckpoint); both
        # are built in instantiate_trainer
        parser.add_class_arguments(ModelCheckpoint, "checkpoint", instantiate=False, fail_untyped=False)
        parser.set_defaults({
            "checkpoint.monitor": self.declaration.monitor,
            "checkpoint.mode": self.declaration.mode,
            "checkpoint.save_last": True,
            "checkpoint.filename": "best-{epoch:03d}-{step}",
            "checkpoint.auto_insert_metric_name": False,
            # the file name holds the step, so a name already there is this run's own checkpoint of that step,
            # written by a process killed before its last.ckpt: the resumed run replaces it (with Lightning's
            # version counter it kept both, best-...-4.ckpt and best-...-4-v1.ckpt, and pointed at the second)
            "checkpoint.enable_version_counter": False,
        })
        for data_attr, model_arg in self.links.items():
            parser.link_arguments(f"data.{data_attr}", f"model.{model_arg}", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        check_deterministic(self.subcommand, trainer, config.get("model"), self.declaration)
        try:  # --trainer.strategy fsdp: what cannot run is refused in one line, before anything is built
            check_sharding(self.subcommand, config)
        except ValueError as err:
            self.parser.error(str(err))
        if self.checkpoint_path is not None:
            config.ckpt_path = self.checkpoint_path  # kept out of parsing: see __init__
        # one checkpoint directory per run root, so `--ckpt_path last` finds the interrupted run
        # (the logger's per-run version directory changes on every launch)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        if self.subcommand in (None, "fit") and trainer.sync_batchnorm and not _uses_gpus(trainer.accelerator):
            raise ValueError(
                "trainer.sync_batchnorm=true synchronises BatchNorm statistics across GPUs (SyncBatchNorm needs CUDA); "
                f"this run trains with accelerator={trainer.accelerator!r} without a GPU. Drop the flag on CPU.")
        if self.subcommand in EVALUATION:
            trainer.sync_batchnorm = False  # nothing trains: BatchNorm uses its running statistics
        if self.subcommand and config.get("weights_only") is None:
            config.weights_only = True  # our checkpoints hold tensors and plain values: never unpickle code
        if self.subcommand == "predict" and config.get("return_predictions") is None:
            # the output callbacks write the predictions (an epoch writer still receives them all): the
            # loop need not keep every batch's (segmentation: every mask) until the end for a return value
            config.return_predictions = False
        if self.subcommand in (None, "fit"):
            self.resume_guard = ResumeGuard(resume_settings(config), parse_allowed(config.get("allow_changed")))
        resume_last = self.subcommand == "fit" and config.get("ckpt_path") == "last"
        if resume_last:
            last = Path(config.checkpoint.dirpath) / LAST_NAME
            if not last.is_file():
                raise FileNotFoundError(
                    f"--ckpt_path last: there is no {last} to resume from (trainer.default_root_dir="
                    f"{trainer.default_root_dir}). Run without --ckpt_path to start afresh, or point "
                    "--trainer.default_root_dir at the interrupted run.")
            read_checkpoint(last)  # an empty or truncated file (a copy cut short) is named before Lightning reads it
        route_loggers_to_run_root(config)
        self.wandb_group = link_wandb_runs(config, self.subcommand, self.checkpoint)
        if resume_last:
            config.ckpt_path = str(last)  # this run root's, whatever callbacks the recipe lists
        if self.checkpoint is None:
            link_image_size(config, self.given_keys)
        link_weights(config, self.checkpoint)

    def after_instantiate_classes(self) -> None:
        logger = self.trainer.logger if self.trainer is not None else None
        if isinstance(logger, WandbLogger):
            self.model.wandb_group = self.wandb_group  # the WandbLogger's group (set above), carried by checkpoints
        for callback in self.trainer.callbacks if self.trainer is not None else []:
            if isinstance(callback, Preemption):
                callback.resume_command = resume_command(self.task, self.user_command, self.trainer.default_root_dir)

    def before_fit(self) -> None:
        # one fit per run root: a second one would write last-v1.ckpt and overwrite the first's config.
        # Taken by the launching rank 0 only (DDP children and other ranks run this too)
        if is_launching_rank_zero(self.trainer):
            self.run_lock = RunLock(self.trainer.default_root_dir)
            self.run_lock.acquire()

    def before_validate(self) -> None:
        # a run root that is a file, or read-only: named now, not as an OSError from the first writer
        # (fit's is checked as before_fit takes the run lock)
        check_run_root(self.trainer.default_root_dir)

    before_test = before_predict = before_validate

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = config["trainer"]
        callbacks = [*_as_list(trainer.get("callbacks")), *self._checkpoints(config["checkpoint"]), ThreadsFollowLoad()]
        if getattr(self, "resume_guard", None) is not None:
            callbacks.append(self.resume_guard)
        if self.subcommand in (None, "fit") and config.get("throughput", True):
            callbacks.append(Throughput())  # a flag, not a listed callback: a recipe's own list keeps it
        # `--trainer.enable_checkpointing false`, `--trainer.enable_progress_bar false` and
        # `--trainer.logger false` switch our default callbacks off instead of letting Lightning
        # refuse the combination
        switches = {Checkpoint: "enable_checkpointing", ProgressBar: "enable_progress_bar",
                    LearningRateMonitor: "logger"}
        unwanted = tuple(kind for kind, key in switches.items() if trainer.get(key) is False)
        callbacks = [c for c in callbacks if not isinstance(c, unwanted)]
        if not stdout_is_terminal():
            # a redrawn bar in a log file is one frame per run: print plain lines instead
            callbacks = [LineProgress() if isinstance(c, RichProgressBar) else c for c in callbacks]
        else:  # Lightning's own bar, with the loss read at the bar's interval (tasks.cli.progress.RichProgress)
            callbacks = [RichProgress() if type(c) is RichProgressBar else c for c in callbacks]
        # atomic checkpoint files for every task, unless the recipe brings its own CheckpointIO
        plugins = _as_list(trainer.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        # `fsdp` is the suite's FSDP2 strategy (tasks/cli/sharding.py), not Lightning's FSDP1
        kwargs.setdefault("strategy", sharded_strategy(trainer.get("strategy", "auto")))
        if self.subcommand in (None, "fit") and str(trainer.get("accelerator")) in ("gpu", "cuda", "auto") \
                and torch.cuda.is_available():
            # cudnn.benchmark and TF32 per recipe (fixed-size crops, 32-true demos), as benchmarks/gpu_suite.py runs
            speed = cuda_speed_settings(self.task, trainer)
            if speed["benchmark"] is not None:
                kwargs.setdefault("benchmark", speed["benchmark"])
            torch.set_float32_matmul_precision(speed["float32_matmul_precision"])
        # Lightning adds the `preemption` callback and the config-saving one to these
        trainer = super().instantiate_trainer(callbacks=callbacks, plugins=plugins, **kwargs)
        self.apply_cpu_plan(trainer)
        return trainer

    def apply_cpu_plan(self, trainer: Trainer) -> None:
        """Torch threads and loader workers from the cores this rank may use (:mod:`layers.machine`), decided
        before Lightning launches the other ranks of this node, which inherit the thread count."""
        affinity, node_cpus = machine_cores()
        accelerator = "cpu" if isinstance(trainer.accelerator, CPUAccelerator) else "gpu"
        workers = getattr(self.datamodule, "num_workers", None)
        if workers is None:
            workers = getattr(self.datamodule, "hparams", {}).get("num_workers", AUTO)
        plan = apply_cpu_plan(plan_cpu(affinity=affinity, node_cpus=node_cpus, ranks_on_node=trainer.num_devices,
                                       accelerator=accelerator, num_workers=workers))
        rank_zero_info(plan.describe())

    @staticmethod
    def _checkpoints(args) -> list[Checkpoint]:
        """The best checkpoints on the metric (a plain ModelCheckpoint; it writes no last.ckpt) and,
        with ``save_last``, ``last.ckpt`` on its own schedule (:class:`LatestCheckpoint`)."""
        args = dict(args)
        save_last = args.pop("save_last")
        best = ModelCheckpoint(**args, save_last=False)
        if not save_last:
            return [best]
        # after the best one: Trainer.checkpoint_callback (`--ckpt_path best`) is the first of them
        return [best, LatestCheckpoint(args["dirpath"], args.get("every_n_train_steps") or 0)]

    def after_fit(self) -> None:
        trainer = self.trainer
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()
        if trainer.global_rank != 0:
            return
        lines = [f"run directory:    {Path(trainer.default_root_dir).resolve()}"]
        for ckpt in trainer.checkpoint_callbacks:
            if isinstance(ckpt, ModelCheckpoint) and ckpt.best_model_path:
                score = f" ({ckpt.monitor}={float(ckpt.best_model_score):.4f})" if ckpt.best_model_score is not None else ""
                lines.append(f"best checkpoint:  {Path(ckpt.best_model_path).resolve()}{score}")
            if getattr(ckpt, "last_model_path", None):
                lines.append(f"last checkpoint:  {Path(ckpt.last_model_path).resolve()}")
        lines += logger_summary(trainer)
        rank_zero_info("\n".join(lines))
        self.check_launched_ranks()

    def after_validate(self) -> None:
        self.check_launched_ranks()

    def after_test(self) -> None:
        if self.trainer.global_rank == 0:
            rank_zero_info(f"predictions:      {(Path(self.trainer.default_root_dir) / 'predictions').resolve()}")
        self.check_launched_ranks()

    def after_predict(self) -> None:
        if self.trainer.global_rank == 0:
            # standard error: translation's predict may be writing its output to standard output
            print(f"predictions:      {self.model.predict_destination}", file=sys.stderr, flush=True)
        self.check_launched_ranks()

    def check_launched_ranks(self) -> None:
        """The command fails when a rank this process launched ended non-zero, even after the run's last
        collective, where no peer was left waiting on it (tasks/cli/preemption.py)."""
        failed = launched_ranks_failed(self.trainer)
        if failed:
            raise RankEnded(
                f"{'; '.join(failed)}, after the run's last collective. What rank 0 wrote under "
                f"{Path(self.trainer.default_root_dir).resolve()} is complete (every rank's share reached it through "
                "a collective), but a process of this job did not end well: look for its cause (the OOM killer, "
                "a segfault) before trusting the machine.")


def is_launching_rank_zero(trainer: Trainer) -> bool:
    """Global rank 0 before DDP has started: the cluster environment's rank (torchrun, SLURM), and
    not a process that Lightning's launcher started for another local rank or node."""
    return (trainer.global_rank == 0 and os.environ.get("LOCAL_RANK", "0") == "0"
            and os.environ.get("NODE_RANK", "0") == "0")


def _uses_gpus(accelerator) -> bool:
    import torch

    name = str(getattr(accelerator, "class_path", accelerator)).lower()
    return torch.cuda.is_available() and ("gpu" in name or "cuda" in name or name == "auto")


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def read_checkpoint_for(command: CommandLine | Sequence[str], model_class: type) -> dict | None:
    """The checkpoint an evaluation subcommand (validate/test/predict) names with ``--ckpt_path``,
    checked; ``None`` for fit, for no checkpoint and for Lightning's aliases (last, best, ...)."""
    if not isinstance(command, CommandLine):
        command = split_command_line(command)
    path = _path_or_none(command.ckpt_path)
    if path is None or path in ("last", "best", "hpc", "registry"):
        return None
    checkpoint = check_checkpoint_file(path, model_class)
    if command.subcommand == "fit" and "averaged_from" in checkpoint:
        raise ValueError(f"{path} is an average of checkpoints ({checkpoint['averaged_from']}): it has no optimizer "
                         "state to resume fit from; evaluate it with validate/test/predict, or export it")
    # a checkpoint without saved arguments is loaded into the recipe's model
    return checkpoint if command.subcommand in EVALUATION and checkpoint.get("hyper_parameters") else None


def checkpoint_arguments(checkpoint: dict) -> dict:
    """The model's constructor arguments saved in a checkpoint, as a config's ``model`` section."""
    hparams = dict(checkpoint.get("hyper_parameters", {}))
    hparams.pop("_instantiator", None)
    hparams.pop("_class_path", None)
    return plain(hparams)


def _path_or_none(value: str | None) -> str | None:
    return None if value in (None, "null", "None") else value
