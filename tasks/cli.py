"""The LightningCLI every task runs: ``python -m tasks.<task> {fit,validate,test,predict}``.

Defaults shared by all tasks (each overridable from YAML or the command line):
- the task's demo recipe when no ``--config`` is given;
- a WandbLogger (project ``suite-<task>``), offline unless an API key is configured,
  writing under ``trainer.default_root_dir``; the resolved config goes into the run;
- ModelCheckpoint on the task's main metric plus ``last.ckpt`` (``--checkpoint.*``);
- a per-step learning-rate monitor and a rich progress bar;
- a fixed seed.
"""
from __future__ import annotations

import os
import sys
from netrc import netrc
from pathlib import Path
from typing import Sequence

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_info

import configs

SUBCOMMANDS = ("fit", "validate", "test", "predict")


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
    """ModelCheckpoint whose ``last.ckpt`` always holds the latest state. Lightning (2.5+) rewrites
    ``last.ckpt`` only when a top-k file is written, so after a non-improving epoch
    ``--ckpt_path last`` would resume from the best epoch instead of the latest one."""

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_refreshed_step = trainer.global_step

    def _refresh_last(self, trainer: Trainer) -> None:
        if (self.save_last and not self._should_skip_saving_checkpoint(trainer)
                and getattr(self, "_last_refreshed_step", -1) != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)


class SaveConfigToRun(SaveConfigCallback):
    """Store the resolved config with the run: ``config.yaml`` in the wandb run's files
    (synced with it) and the values as wandb config; with no wandb logger, in the
    run's root directory. Overwrites, so re-running a command never aborts."""

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # runs on rank 0 only: no collective calls here (trainer.log_dir broadcasts, so it would hang DDP)
        text = self.parser.dump(self.config, skip_none=False)
        logger = trainer.logger
        if isinstance(logger, WandbLogger):
            (Path(logger.experiment.dir) / "config.yaml").write_text(text)
            logger.experiment.config.update(yaml.safe_load(text), allow_val_change=True)
        else:
            target = Path(trainer.default_root_dir)
            target.mkdir(parents=True, exist_ok=True)
            (target / "config.yaml").write_text(text)


class SuiteCLI(LightningCLI):
    """LightningCLI with the suite's defaults. ``links`` maps datamodule attributes to model
    arguments that must come from the data (``{"num_classes": "num_classes"}``)."""

    def __init__(self, model_class: type[LightningModule], datamodule_class: type[LightningDataModule], *,
                 task: str, default_config: str, monitor: str, mode: str = "max",
                 links: dict[str, str] | None = None, args: Sequence[str] | None = None, run: bool = True):
        self.task = task
        self.monitor = monitor
        self.mode = mode
        self.links = links or {}
        default = recipe_path(task, default_config)
        if args is None:  # from the command line: edit argv so LightningCLI sees one source of args
            sys.argv[1:] = with_default_config(sys.argv[1:], default)
        else:
            args = with_default_config(list(args), default)
        super().__init__(
            model_class,
            datamodule_class,
            save_config_callback=SaveConfigToRun,
            save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
            seed_everything_default=0,
            auto_configure_optimizers=False,  # optimizer/scheduler are model arguments
            args=args,
            run=run,
        )

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

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        # one checkpoint directory per run root, so `--ckpt_path last` finds the interrupted run
        # (the logger's per-run version directory changes on every launch)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")
        if trainer.sync_batchnorm and not _uses_gpus(trainer.accelerator):
            raise ValueError(
                "trainer.sync_batchnorm=true synchronises BatchNorm statistics across GPUs (SyncBatchNorm needs CUDA); "
                f"this run uses accelerator={trainer.accelerator!r} without a GPU. Drop the flag on CPU.")
        if self.subcommand and config.get("weights_only") is None:
            config.weights_only = True  # our checkpoints hold tensors and plain values: never unpickle code
        if self.subcommand and config.get("ckpt_path") not in (None, "last", "best", "hpc", "registry"):
            check_checkpoint_file(config.ckpt_path)
        self._route_wandb_to_run_root(config)

    def _route_wandb_to_run_root(self, config) -> None:
        # wandb writes under the run's root dir unless the recipe names another save_dir
        # (WandbLogger's own default, ".", would scatter runs over the working directory)
        logger = config.trainer.logger
        if getattr(logger, "class_path", "").endswith("WandbLogger") and logger.init_args.get("save_dir") in (None, "."):
            Path(config.trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
            logger.init_args.save_dir = config.trainer.default_root_dir

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
        return super()._instantiate_trainer(config, callbacks)

    def after_fit(self) -> None:
        trainer = self.trainer
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
            if trainer.logger.experiment.settings.mode == "offline":
                lines.append(f"                  offline; upload later with `wandb sync {run_dir}`")
        rank_zero_info("\n".join(lines))

    def after_test(self) -> None:
        if self.trainer.global_rank == 0:
            rank_zero_info(f"predictions:      {(Path(self.trainer.default_root_dir) / 'predictions').resolve()}")


def _uses_gpus(accelerator) -> bool:
    import torch

    name = str(getattr(accelerator, "class_path", accelerator)).lower()
    return torch.cuda.is_available() and ("gpu" in name or "cuda" in name or name == "auto")


def check_checkpoint_file(path: str) -> None:
    """Refuse a missing, truncated or foreign checkpoint with its path before any work starts
    (the error torch raises deep inside Lightning does not name the file)."""
    import torch

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {file} does not exist")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {file} ({file.stat().st_size} bytes): {err}. "
                         "Is it truncated (an interrupted copy or download)?") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint or "pytorch-lightning_version" not in checkpoint:
        keys = list(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{file} is not a Lightning checkpoint of this suite (top-level keys: {keys}). "
                         "To start from foreign weights (timm, CVNets), use the backbone's `pretrained` "
                         "argument or the classification task's `weights`.")


def with_default_config(args: list[str], default: Path) -> list[str]:
    """Insert ``--config <default>`` after the subcommand when the user gave no config."""
    if any(a == "--config" or a.startswith("--config=") for a in args):
        return args
    for i, a in enumerate(args):
        if a in SUBCOMMANDS:
            return args[: i + 1] + ["--config", str(default)] + args[i + 1:]
    return args
