"""The callback of benchmarks/gpu_nccl.py's strategy check, apart so that its stuck children start without
Lightning: ``--trainer.callbacks+=process_group_probe.ProcessGroupProbe`` (benchmarks/ on ``PYTHONPATH``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback


class ProcessGroupProbe(Callback):
    """Writes ``{initialized, strategy, strategy_timeout_s, backend, world_size, process_group_timeout_s}`` to
    ``output`` when the trainer sets up (the strategy has made its process group by then)."""

    def __init__(self, output: str):
        self.output = output

    def setup(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        timeout = getattr(strategy, "_timeout", None)  # Lightning's DDPStrategy keeps it there, with no property
        row = {"initialized": dist.is_initialized(), "strategy": type(strategy).__name__,
               "strategy_timeout_s": timeout.total_seconds() if timeout is not None else None}
        if dist.is_initialized():
            # torch has no public getter for a group's timeout (``dist.set_timeout`` only sets it): read it from the
            # backend's options, where ProcessGroupNCCL's watchdog (gloo's waits, on CPU) takes it from -- what the
            # check is about, rather than the value the strategy meant to pass
            backend = dist.group.WORLD._get_backend(strategy.root_device)
            row.update(backend=dist.get_backend(), world_size=dist.get_world_size(),
                       process_group_timeout_s=backend.options._timeout.total_seconds())
        Path(self.output).write_text(json.dumps(row))
