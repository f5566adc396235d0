"""Where a run logs: the default logger, every logger's folder under the run root, the wandb group that ties a
model's fit, validate, test and predict runs together, the resolved config saved with the run, and the lines
the end of ``fit`` prints about the logger."""
from __future__ import annotations

import os
import uuid
from netrc import netrc
from pathlib import Path

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

from configs.recipes import CONFIG_FILE_NAME
from tasks.cli.last_checkpoint import LAST_NAME
from tasks.cli.resume import make_run_root
from tasks.engine.checkpoints import read_checkpoint


def wandb_has_credentials() -> bool:
    """True when wandb could log online: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, OSError, Exception):
        return False


def default_logger(task: str) -> dict:
    """The logger a run gets unless its recipe or ``--trainer.logger`` names another: wandb, project
    ``suite-<task>``, offline unless an API key is configured."""
    return {"class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"project": f"suite-{task}", "offline": not wandb_has_credentials()}}


def route_loggers_to_run_root(config) -> None:
    """Every logger writes under the run's root unless the recipe names another directory (their own
    defaults, ``.`` or ``lightning_logs``, scatter runs over the working directory)."""
    loggers = config.trainer.logger
    for logger in loggers if isinstance(loggers, list) else [loggers]:
        init_args = getattr(logger, "init_args", None)
        if init_args is None:
            continue
        key = "save_dir" if "save_dir" in init_args or "root_dir" not in init_args else "root_dir"
        if init_args.get(key) in (None, ".", "", "lightning_logs"):
            make_run_root(config.trainer.default_root_dir)
            init_args[key] = config.trainer.default_root_dir


def link_wandb_runs(config, subcommand: str | None, checkpoint: dict | None) -> str | None:
    """Fit, validate, test and predict runs of one model share a wandb group (the checkpoint's, or the
    interrupted fit's with ``--ckpt_path last``); the job type says which subcommand made each run.
    Returns the group, ``None`` without a WandbLogger."""
    logger = config.trainer.logger
    if not getattr(logger, "class_path", "").endswith("WandbLogger"):
        return None
    init_args = logger.init_args
    if init_args.get("job_type") is None:
        init_args["job_type"] = subcommand or "fit"
    if init_args.get("group") is None:
        saved = (checkpoint or {}).get("wandb_group")
        if saved is None and config.get("ckpt_path") == "last":
            last = Path(config.checkpoint.dirpath) / LAST_NAME
            saved = read_checkpoint(last).get("wandb_group") if last.is_file() else None
        init_args["group"] = saved or f"{Path(config.trainer.default_root_dir).name}-{uuid.uuid4().hex[:8]}"
    return init_args["group"]


def logger_summary(trainer: Trainer) -> list[str]:
    """The lines the end of ``fit`` prints about where the logger wrote."""
    if not isinstance(trainer.logger, WandbLogger):
        return []
    run_dir = Path(trainer.logger.experiment.dir).parent
    lines = [f"wandb run:        {run_dir}"]
    if trainer.logger.experiment.settings.mode in ("offline", "dryrun"):
        lines.append(f"                  offline; upload later with `wandb sync {run_dir}`")
    return lines


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
