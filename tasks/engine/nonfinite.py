"""The loss verdict of a training step on its way from the device to the host: whether the loss was finite
and usable on every rank, read without making the step wait (see ``TaskModule.guard_loss``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LossVerdict:
    """One training batch's loss verdict on its way to the host: ``values`` holds (finite, usable,
    loss); from a GPU it is a pinned copy made without waiting, readable once the event ``copied``
    (recorded right after the loss, ahead of the backward) has passed."""

    step: int
    epoch: int
    batch: int
    values: torch.Tensor
    copied: Any = None

    @classmethod
    def copy(cls, step: int, epoch: int, batch: int, values: torch.Tensor) -> "LossVerdict":
        if values.device.type != "cuda":  # on the host already (other accelerators: a plain copy)
            return cls(step, epoch, batch, values.cpu())
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(step, epoch, batch, host, copied)

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def read(self) -> tuple[bool, bool, float]:
        """(finite on every rank, usable on every rank, this rank's loss); waits for the copy only."""
        if self.copied is not None:
            self.copied.synchronize()
        finite, usable, loss = self.values.tolist()
        return finite > 0, usable > 0, loss
