"""The LightningCLI every task runs: ``python -m tasks.<task> {fit,validate,test,predict,export}``.

Defaults shared by all tasks (each overridable from YAML or the command line):
- the task's demo recipe when no ``--config`` is given;
- a WandbLogger (project ``suite-<task>``), offline unless an API key is configured, writing
  under ``trainer.default_root_dir``; fit, validate, test and predict runs of one model share a
  wandb group (carried by the checkpoint) with the subcommand as job type; the resolved config
  goes into the run as ``suite_config.yaml``;
- ModelCheckpoint on the task's main metric plus ``last.ckpt``, written on its own schedule
  (every ``every_n_train_steps`` and every epoch end) whether or not the metric exists yet;
- a per-step learning-rate monitor; a Rich progress bar on a terminal, plain progress lines
  (:class:`tasks.progress.LineProgress`) when the output goes to a file;
- a fixed seed;
- freed CPU memory kept for reuse instead of unmapped (:mod:`tasks.runtime`);
- checkpoints written atomically beside their destination (:mod:`tasks.checkpoint_io`);
- on ``fit``: SIGTERM / SIGUSR1 stop every rank at a step boundary with ``last.ckpt`` written and
  exit code ``128 + signal`` (:mod:`tasks.preemption`; ``--preemption.signals`` names others);
  a resume whose data order, global batch, optimizer or schedule differ from the checkpoint's
  is refused unless ``--allow_changed`` names the differences, and a second ``fit`` in a run
  root in use is refused (:mod:`tasks.resume`);
- a flag placed before a ``--config`` that sets the same key is refused (the recipe would win).

With ``--ckpt_path`` on ``validate``/``test``/``predict`` the checkpoint supplies the model:
its saved constructor arguments (backbone and head, class names, category ids, vocabulary)
rebuild it, and only ``--model.*`` arguments given on the command line override them.

``export --ckpt_path X`` writes the checkpoint's model as ONNX (see :mod:`tasks.export`); it
needs no Trainer, so it is answered before LightningCLI parses anything.
"""
from __future__ import annotations

import os
import sys
import uuid
from netrc import netrc
from pathlib import Path
from typing import Optional, Sequence

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info

import configs
from tasks.base import qualified_name
from tasks.checkpoint_io import AtomicCheckpointIO
from tasks.preemption import Preemption, resume_command
from tasks.progress import LineProgress, stdout_is_terminal
from tasks.resume import ResumeGuard, RunLock, parse_allowed, resume_settings
from tasks.runtime import reuse_freed_memory

SUBCOMMANDS = ("fit", "validate", "test", "predict")
EXPORT = "export"
EVALUATION = ("validate", "test", "predict")
CONFIG_FILE_NAME = "suite_config.yaml"  # wandb keeps "config.yaml" for itself


def wandb_has_credentials() -> bool:
    """True when wandb could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, OSError, Exception):
        return False


def recipe_path(task: str, name: str) -> Path:
    """Path of a shipped recipe, e.g. ``recipe_path("classify", "demo_mobilevitv2.yaml")``."""
    return Path(configs.__file__).parent / task / name


class LatestAndBestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose ``last.ckpt`` always holds the latest state, on its own schedule.

    Lightning (2.5+) rewrites ``last.ckpt`` only together with a top-k file, and holds step-based
    saves back until the monitored metric exists: a run killed before its first validation (a
    whole epoch, or three in a recipe validating every third) left nothing to resume from. Here
    ``last.ckpt`` is written every ``every_n_train_steps`` steps and at every training epoch end,
    whatever the metric; the best checkpoints still follow the metric."""

    def _refresh_last(self, trainer: Trainer) -> None:
        if (not self.save_last or trainer.sanity_checking or trainer.state.fn != "fit" or trainer.fast_dev_run
                or getattr(self, "_last_refreshed_step", -1) == trainer.global_step):
            return
        # a last-only save must not make the top-k save of the same step look done already
        top_k_step = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_global_step_saved = top_k_step
        self._last_refreshed_step = trainer.global_step

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_refreshed_step = trainer.global_step

    def save_last_now(self, trainer: Trainer) -> None:
        """Write ``last.ckpt`` for the current step unless it holds it already (a preempted run's
        last save, :mod:`tasks.preemption`)."""
        self._refresh_last(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._every_n_train_steps > 0 and trainer.global_step % self._every_n_train_steps == 0:
            self._refresh_last(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._refresh_last(trainer)


class SaveConfigToRun(SaveConfigCallback):
    """Store the resolved config with the run: ``suite_config.yaml`` in the wandb run's files
    (synced with it; wandb reserves ``config.yaml``) and the values as wandb config; with no
    wandb logger, in the run's root directory. Overwrites, so re-running a command never aborts."""

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # runs on rank 0 only: no collective calls here (trainer.log_dir broadcasts, so it would hang DDP)
        text = self.parser.dump(self.config, skip_none=False)
        logger = trainer.logger
        if isinstance(logger, WandbLogger):
            (Path(logger.experiment.dir) / CONFIG_FILE_NAME).write_text(text)
            logger.experiment.config.update(yaml.safe_load(text), allow_val_change=True)
        else:
            target = Path(trainer.default_root_dir)
            target.mkdir(parents=True, exist_ok=True)
            (target / CONFIG_FILE_NAME).write_text(text)


class SuiteCLI(LightningCLI):
    """LightningCLI with the suite's defaults. The model's ``DATA_LINKS`` (datamodule attribute ->
    constructor argument) are linked on ``fit`` and on evaluations without a checkpoint; with a
    checkpoint they come from it, and the task checks them against the data it scores."""

    def __init__(self, model_class: type[LightningModule], datamodule_class: type[LightningDataModule], *,
                 task: str, default_config: str, monitor: str, mode: str = "max",
                 args: Sequence[str] | None = None, run: bool = True):
        reuse_freed_memory()
        self.task = task
        self.user_argv = list(sys.argv[1:] if args is None else args)  # as typed: for the resume command
        self.monitor = monitor
        self.mode = mode
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0] == EXPORT:
            from tasks.export import run_export

            run_export(argv[1:], model_class, prog=f"python -m tasks.{task} export")
            return
        argv = with_default_config(argv, recipe_path(task, default_config))
        self.checkpoint = read_checkpoint_for(argv, model_class)
        # --print_config prints while parsing, before the checkpoint's arguments are merged: with a
        # checkpoint, print once they are (see _parse_ckpt_path), so it shows the model that will run
        self.print_config_after_checkpoint = self.checkpoint is not None and "--print_config" in argv
        if self.print_config_after_checkpoint:
            argv = [a for a in argv if a != "--print_config"]
        if args is None:  # from the command line: edit argv so LightningCLI sees one source of args
            sys.argv[1:] = argv
        else:
            args = argv
        self.argv = argv
        self.default_datamodule = f"{datamodule_class.__module__}.{datamodule_class.__qualname__}"
        self.links = {} if self.checkpoint is not None else dict(getattr(model_class, "DATA_LINKS", {}))
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
            args=args,
            run=run,
        )

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # listed so that `--help` shows it; SuiteCLI.__init__ runs it before any parsing
        from tasks.export import export_parser

        prog = f"python -m tasks.{self.task} export"
        parser._subcommands_action.add_subcommand(
            EXPORT, export_parser(self.model_class, prog),
            help="Export the checkpoint's model to ONNX and check it against PyTorch with ONNX Runtime")

    def add_arguments_to_parser(self, parser) -> None:
        # trainer defaults as plain config, so --print_config shows them and recipes override them
        parser.set_defaults({
            "trainer.default_root_dir": f"runs/{self.task}",
            "trainer.logger": {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {"project": f"suite-{self.task}", "offline": not wandb_has_credentials()},
            },
            "trainer.callbacks": [
                {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
                {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
                 "init_args": {"logging_interval": "step"}},
            ],
        })
        parser.set_defaults({"data": {"class_path": self.default_datamodule}})
        parser.add_argument(
            "--allow_changed", type=Optional[str], default=None,
            help="fit --ckpt_path: comma-separated settings (e.g. data.batch_size,model.optimizer) that may differ "
                 "from the checkpoint's; without it such a resume is refused (see tasks/resume.py)")
        parser.add_lightning_class_args(Preemption, "preemption")
        parser.add_lightning_class_args(LatestAndBestCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": self.monitor,
            "checkpoint.mode": self.mode,
            "checkpoint.save_last": True,
            "checkpoint.filename": "best-{epoch:03d}-{step}",
            "checkpoint.auto_insert_metric_name": False,
        })
        for data_attr, model_arg in self.links.items():
            parser.link_arguments(f"data.{data_attr}", f"model.{model_arg}", apply_on="instantiate")
        if self.checkpoint is not None:
            # the data-derived arguments are required; the checkpoint holds them
            saved = self.checkpoint.get("hyper_parameters", {})
            parser.set_defaults({f"model.{arg}": saved[arg] for arg in self._model_class.DATA_LINKS.values()
                                 if arg in saved})

    def _parse_ckpt_path(self) -> None:
        """The checkpoint's constructor arguments rebuild the model; ``--model.*`` arguments given
        on the command line still win (Lightning's own merge lets the checkpoint win over them)."""
        if self.checkpoint is None:
            return
        hparams = dict(self.checkpoint.get("hyper_parameters", {}))
        hparams.pop("_instantiator", None)
        hparams.pop("_class_path", None)
        if not hparams:
            return
        sub = self.config.subcommand
        self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)
        overrides = model_overrides(self.argv)
        subparser = self.parser._subcommands_action._name_parser_map[sub]
        if overrides:
            self.config[sub] = subparser.parse_args(overrides, namespace=self.config[sub].clone())
        if self.print_config_after_checkpoint:
            sys.stdout.write(subparser.dump(self.config[sub], skip_none=False))
            sys.exit(0)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
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
        if self.subcommand in (None, "fit"):
            self.resume_guard = ResumeGuard(resume_settings(config), parse_allowed(config.get("allow_changed")))
        if self.subcommand == "fit" and config.get("ckpt_path") == "last":
            last = Path(config.checkpoint.dirpath) / "last.ckpt"
            if not last.is_file():
                raise FileNotFoundError(
                    f"--ckpt_path last: there is no {last} to resume from (trainer.default_root_dir="
                    f"{trainer.default_root_dir}). Run without --ckpt_path to start afresh, or point "
                    "--trainer.default_root_dir at the interrupted run.")
        self._route_loggers_to_run_root(config)
        self._link_wandb_runs(config)

    def _route_loggers_to_run_root(self, config) -> None:
        # every logger writes under the run's root unless the recipe names another directory
        # (their own defaults, "." or lightning_logs, scatter runs over the working directory)
        loggers = config.trainer.logger
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            init_args = getattr(logger, "init_args", None)
            if init_args is None:
                continue
            key = "save_dir" if "save_dir" in init_args or not "root_dir" in init_args else "root_dir"
            if init_args.get(key) in (None, ".", "", "lightning_logs"):
                Path(config.trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
                init_args[key] = config.trainer.default_root_dir

    def _link_wandb_runs(self, config) -> None:
        # fit, validate, test and predict runs of one model share a wandb group; the job type
        # says which subcommand made each run
        logger = config.trainer.logger
        if not getattr(logger, "class_path", "").endswith("WandbLogger"):
            return
        init_args = logger.init_args
        if init_args.get("job_type") is None:
            init_args["job_type"] = self.subcommand or "fit"
        if init_args.get("group") is None:
            saved = (self.checkpoint or {}).get("wandb_group")
            if saved is None and config.get("ckpt_path") == "last":
                last = Path(config.checkpoint.dirpath) / "last.ckpt"
                saved = read_checkpoint(last).get("wandb_group") if last.is_file() else None
            init_args["group"] = saved or f"{Path(config.trainer.default_root_dir).name}-{uuid.uuid4().hex[:8]}"

    def after_instantiate_classes(self) -> None:
        logger = self.trainer.logger if self.trainer is not None else None
        if isinstance(logger, WandbLogger):
            self.model.wandb_group = logger._wandb_init.get("group")
        for callback in self.trainer.callbacks if self.trainer is not None else []:
            if isinstance(callback, Preemption):
                callback.resume_command = resume_command(self.task, self.user_argv, self.trainer.default_root_dir)

    def before_fit(self) -> None:
        # one fit per run root: a second one would write last-v1.ckpt and overwrite the first's config.
        # Taken by the launching rank 0 only (DDP children and other ranks run this too)
        if is_launching_rank_zero(self.trainer):
            self.run_lock = RunLock(self.trainer.default_root_dir)
            self.run_lock.acquire()

    def _instantiate_trainer(self, config: dict, callbacks: list) -> Trainer:
        # `--trainer.enable_checkpointing false`, `--trainer.enable_progress_bar false` and
        # `--trainer.logger false` switch our default callbacks off instead of letting Lightning
        # refuse the combination
        switches = {ModelCheckpoint: "enable_checkpointing", ProgressBar: "enable_progress_bar",
                    LearningRateMonitor: "logger"}
        unwanted = tuple(kind for kind, key in switches.items() if config.get(key) is False)
        if unwanted:
            callbacks = [c for c in callbacks if not isinstance(c, unwanted)]
            config["callbacks"] = [c for c in config.get("callbacks") or [] if not isinstance(c, unwanted)]
        # atomic checkpoint files for every task, unless the recipe brings its own CheckpointIO
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            config["plugins"] = plugins + [AtomicCheckpointIO()]
        if getattr(self, "resume_guard", None) is not None:
            callbacks = [*callbacks, self.resume_guard]
        if not stdout_is_terminal():
            # a redrawn bar in a log file is one frame per run: print plain lines instead
            config["callbacks"] = [LineProgress() if isinstance(c, RichProgressBar) else c
                                   for c in config.get("callbacks") or []]
        return super()._instantiate_trainer(config, callbacks)

    def after_fit(self) -> None:
        trainer = self.trainer
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()
        if trainer.global_rank != 0:
            return
        lines = [f"run directory:    {Path(trainer.default_root_dir).resolve()}"]
        ckpt = trainer.checkpoint_callback
        if isinstance(ckpt, ModelCheckpoint):
            if ckpt.best_model_path:
                score = f" ({ckpt.monitor}={float(ckpt.best_model_score):.4f})" if ckpt.best_model_score is not None else ""
                lines.append(f"best checkpoint:  {Path(ckpt.best_model_path).resolve()}{score}")
            if ckpt.last_model_path:
                lines.append(f"last checkpoint:  {Path(ckpt.last_model_path).resolve()}")
        if isinstance(trainer.logger, WandbLogger):
            run_dir = Path(trainer.logger.experiment.dir).parent
            lines.append(f"wandb run:        {run_dir}")
            if trainer.logger.experiment.settings.mode in ("offline", "dryrun"):
                lines.append(f"                  offline; upload later with `wandb sync {run_dir}`")
        rank_zero_info("\n".join(lines))

    def after_test(self) -> None:
        if self.trainer.global_rank == 0:
            rank_zero_info(f"predictions:      {(Path(self.trainer.default_root_dir) / 'predictions').resolve()}")

    def after_predict(self) -> None:
        if self.trainer.global_rank == 0:
            # standard error: translation's predict may be writing its output to standard output
            print(f"predictions:      {self.model.predict_destination}", file=sys.stderr, flush=True)


def is_launching_rank_zero(trainer: Trainer) -> bool:
    """Global rank 0 before DDP has started: the cluster environment's rank (torchrun, SLURM), and
    not a process that Lightning's launcher started for another local rank or node."""
    return (trainer.global_rank == 0 and os.environ.get("LOCAL_RANK", "0") == "0"
            and os.environ.get("NODE_RANK", "0") == "0")


def _uses_gpus(accelerator) -> bool:
    import torch

    name = str(getattr(accelerator, "class_path", accelerator)).lower()
    return torch.cuda.is_available() and ("gpu" in name or "cuda" in name or name == "auto")


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


def read_checkpoint_for(argv: list[str], model_class: type) -> dict | None:
    """The checkpoint an evaluation subcommand (validate/test/predict) names with ``--ckpt_path``,
    checked; ``None`` for fit, for no checkpoint and for Lightning's aliases (last, best, ...)."""
    subcommand = next((a for a in argv if a in SUBCOMMANDS), None)
    path = option_value(argv, "--ckpt_path")
    if path in (None, "null", "None"):
        return None
    if path in ("last", "best", "hpc", "registry"):
        return None
    checkpoint = check_checkpoint_file(path, model_class)
    if subcommand == "fit" and "averaged_from" in checkpoint:
        raise ValueError(f"{path} is an average of checkpoints ({checkpoint['averaged_from']}): it has no optimizer "
                         "state to resume fit from; evaluate it with validate/test/predict, or export it")
    # a checkpoint without saved arguments (written before they were) is loaded into the recipe's model
    return checkpoint if subcommand in EVALUATION and checkpoint.get("hyper_parameters") else None


def option_value(argv: list[str], name: str) -> str | None:
    """The value of ``name`` in an argument list (``--name value`` or ``--name=value``; the last wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def model_overrides(argv: list[str]) -> list[str]:
    """The ``--model.*`` arguments of an argument list, with their values, in order."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--model.") or arg.startswith("--model="):
            out.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                out.append(argv[i + 1])
    return out


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
