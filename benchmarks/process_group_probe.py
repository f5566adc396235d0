"""The callback of benchmarks/gpu_nccl.py's strategy check, apart so that its stuck children start without
Lightning: ``--trainer.callbacks+=process_group_probe.ProcessGroupProbe`` (benchmarks/ on ``PYTHONPATH``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback

from layers.compat import process_group_timeout, strategy_timeout


class ProcessGroupProbe(Callback):
    """Writes ``{initialized, strategy, strategy_timeout_s, backend, world_size, process_group_timeout_s}`` to
    ``output`` when the trainer sets up (the strategy has made its process group by then)."""

    def __init__(self, output: str):
        self.output = output

    def setup(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        timeout = strategy_timeout(strategy)
        row = {"initialized": dist.is_initialized(), "strategy": type(strategy).__name__,
               "strategy_timeout_s": timeout.total_seconds() if timeout is not None else None}
        if dist.is_initialized():
            # the group's own timeout, where NCCL's watchdog (gloo's waits, on CPU) takes it from: what the check is
            # about, rather than the value the strategy meant to pass
            row.update(backend=dist.get_backend(), world_size=dist.get_world_size(),
                       process_group_timeout_s=process_group_timeout(strategy.root_device).total_seconds())
        Path(self.output).write_text(json.dumps(row))
