"""The non-finite-loss guard: a NaN/inf loss never updates the weights, and a training step never makes the
host wait for the device to find out.

Each training batch's verdict (finite, and usable on every rank) is computed on the device, copied to the host
without waiting (:class:`LossVerdict`), and turned into a no-op update on the device where the optimizer allows
it (a fused optimizer's ``found_inf``). Without a gradient scaler, the total gradient norm the clipping computes
joins the verdict the same way (a NaN/inf gradient from a finite loss). The host reads the verdicts later: as
they arrive (under DDP: exactly those two steps old, so that every rank decides at the same step), and all of
them before any checkpoint, validation or the end of training. A non-finite loss or gradient then raises, naming
its step and batch, or (``on_nonfinite_loss="skip"``) is warned about and counted, and the per-step learning-rate
schedule is moved back one step. :class:`NonFiniteGuard` is the whole
mechanism; ``TaskModule`` calls it from its training hooks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn

from layers.compat import loss_scale_state, skip_update_on_device, supports_device_skip
from tasks.engine.optim import rewind_schedule


#: under DDP, how many optimizer steps a verdict stays unread before a batch start waits for it: at step N every
#: rank reads exactly the verdicts of steps <= N - 2, whose copies finished a step ago (TaskModule.on_train_batch_start)
DDP_VERDICT_LAG = 2


@dataclass
class LossVerdict:
    """One training batch's verdict on its way to the host: ``values`` holds (finite, usable, value) of
    ``what`` (``"loss"``, or ``"gradient"``: the total gradient norm of a step whose loss was usable);
    from a GPU it is a pinned copy made without waiting, readable once the event ``copied`` (recorded
    right after the copy was queued) has passed."""

    step: int
    epoch: int
    batch: int
    values: torch.Tensor
    copied: Any = None
    what: str = "loss"

    @classmethod
    def copy(cls, step: int, epoch: int, batch: int, values: torch.Tensor, what: str = "loss",
             event: type | None = None) -> "LossVerdict":
        """The verdict ``values`` on their way to the host. From a CUDA device (or with ``event``, a class with
        CUDA events' ``record``/``query``/``synchronize``, which drives this path on the CPU): a pinned buffer
        filled without waiting and an event recorded after the copy."""
        on_cuda = values.device.type == "cuda"
        if not on_cuda and event is None:  # on the host already (other accelerators: a plain copy)
            return cls(step, epoch, batch, values.cpu(), what=what)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=on_cuda)
        host.copy_(values, non_blocking=True)
        copied = (event or torch.cuda.Event)()
        copied.record()
        return cls(step, epoch, batch, host, copied, what)

    def ready(self) -> bool:
        return self.copied is None or self.copied.query()

    def read(self) -> tuple[bool, bool, float]:
        """(finite on every rank, usable on every rank, this rank's loss); waits for the copy only."""
        if self.copied is not None:
            self.copied.synchronize()
        finite, usable, loss = self.values.tolist()
        return finite > 0, usable > 0, loss


def zero_loss(module: nn.Module) -> torch.Tensor:
    """A zero loss that reaches every trainable parameter of ``module`` (DDP's gradient all-reduce
    waits for all of them)."""
    return sum(p.sum() for p in module.parameters() if p.requires_grad) * 0.0


def where(step: int, epoch: int, batch_idx: int) -> str:
    return f"global step {step} (epoch {epoch}, batch {batch_idx})"


class NonFiniteGuard:
    """The guard of one LightningModule's training (see the module's docstring).

    Args:
        on_nonfinite_loss: ``"raise"`` stops the run at a NaN/inf loss; ``"skip"`` skips that step on every
            rank and counts it (``skipped_nonfinite_steps``, logged as ``train/skipped_nonfinite_steps``).
    """

    def __init__(self, on_nonfinite_loss: Literal["raise", "skip"] = "raise"):
        self.on_nonfinite_loss = on_nonfinite_loss
        self.skipped_nonfinite_steps = 0
        self.skipped_empty_batches = 0
        self.logged_nonfinite_steps = 0
        self.verdicts: list[LossVerdict] = []  # on their way to the host, oldest first
        self.step_usable: torch.Tensor | None = None  # device verdict of this optimizer step's batches
        self.step_finite: torch.Tensor | None = None  # ... and whether all their losses were finite
        self.kept_scale: tuple | None = None  # (keep?, scale, growth tracker) to restore after an fp16 step
        self.applied_usable: torch.Tensor | None = None  # the verdict the coming update was given
        self.last_batch = 0  # the batch index of the latest guarded batch (the step's last, under accumulation)
        self.rewound_step = -1  # the latest skipped step the schedule was moved back for

    def reset_counts(self) -> None:
        self.skipped_nonfinite_steps = self.logged_nonfinite_steps = 0

    def guard(self, module: LightningModule, loss: torch.Tensor | None, batch_idx: int) -> torch.Tensor | None:
        """The loss to train on; the verdict on it is reached on the device and read later.

        ``loss=None`` (a batch with nothing left to train on) is known on the host: in one process Lightning
        skips that step; under DDP the rank trains on a zero loss that reaches every parameter, so the
        gradient all-reduce the other ranks wait for happens, and the verdict skips the update on every rank."""
        trainer = module.trainer
        self.last_batch = batch_idx
        empty = loss is None
        distributed = trainer.world_size > 1
        if empty and not distributed:
            self.count_empty_batch(where(module.global_step, module.current_epoch, batch_idx))
            return None
        if empty:
            loss = zero_loss(module)
        finite = torch.isfinite(loss.detach()).all()
        # a batch with nothing to train on is not a non-finite loss: finite, but not usable
        verdict = torch.stack([finite, torch.zeros_like(finite) if empty else finite]).float()
        if distributed:  # every rank skips if one must; no barrier, so the host does not wait
            torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN)
        usable, finite_everywhere = verdict[1] > 0, verdict[0] > 0
        self.step_usable = usable if self.step_usable is None else self.step_usable & usable
        self.step_finite = finite_everywhere if self.step_finite is None else self.step_finite & finite_everywhere
        self.verdicts.append(LossVerdict.copy(module.global_step, module.current_epoch, batch_idx,
                                              torch.cat([verdict, loss.detach().float().reshape(1)])))
        return loss

    def before_optimizer_step(self, module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """Apply this step's verdict to the update, on the device where the optimizer allows it.

        A fused optimizer (``fused=True``: Adam, AdamW, SGD, Adagrad) skips its whole update, state and step
        count included, when its ``found_inf`` tensor is non-zero (the mechanism a gradient scaler uses,
        :func:`skip_update_on_device`). Under fp16 the scaler sets that tensor itself from its check of the
        gradients, so a step to skip gets a non-finite gradient instead. Other optimizers, and a fused one
        before its first update (fused SGD leaves its momentum buffer uninitialised when its first update is
        skipped), read the verdict on the host here, after the backward is queued: a non-finite loss raises
        before the update, and a step to skip drops its gradients. With gradient accumulation one unusable
        batch skips the whole accumulated step."""
        usable, self.step_usable = self.step_usable, None
        finite, self.step_finite = self.step_finite, None
        self.applied_usable = usable
        if usable is None:  # nothing was trained on: no gradients to apply
            return
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        if supports_device_skip(optimizer) and scaler is not None:
            grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            grad = next(grads, None)
            if grad is not None:
                grad.masked_fill_(~usable, float("nan"))
                # the scaler takes that gradient for an overflow and halves its scale: right for a non-finite
                # loss (fp16 overflowing), wrong for a batch with nothing to train on (finite, not usable)
                scale, growth = loss_scale_state(scaler)
                self.kept_scale = (finite & ~usable, scale.clone(), growth.clone())
            return
        if supports_device_skip(optimizer) and optimizer.state:
            skip_update_on_device(optimizer, ~usable)
            return
        if not all(ok for step, ok in self.resolve(module, wait=True, log=True) if step == module.global_step):
            optimizer.zero_grad(set_to_none=True)

    def check_gradient_norm(self, module: LightningModule, optimizer: torch.optim.Optimizer,
                            total_norm: torch.Tensor) -> None:
        """Join the step's total gradient norm (``clip_grad_norm_``'s result, already on the device) to its verdict,
        for a step without a gradient scaler (bf16, fp32): a NaN/inf gradient from a finite loss (an overflow in
        the backward) skips the update like a non-finite loss, decided on the device where the loss's verdict
        was (a fused optimizer's ``found_inf``, updated in place before its step), and is reported on the host
        later as a non-finite gradient. A step whose loss was already unusable is not reported twice."""
        usable = self.applied_usable
        if usable is None:
            return
        gradient_ok = torch.isfinite(total_norm.detach()) | ~usable  # a skipped step's gradient is not news
        device_skip = vars(optimizer).get("found_inf")
        if device_skip is not None:  # the fused step reads it: exactly 1.0 skips
            device_skip.copy_(torch.maximum(device_skip, (~gradient_ok).float()))
        elif not bool(gradient_ok):  # the host path read its verdict already (one sync more, on that path only)
            optimizer.zero_grad(set_to_none=True)
        values = torch.stack([gradient_ok.float(), gradient_ok.float(), total_norm.detach().float().reshape(())])
        self.verdicts.append(LossVerdict.copy(module.global_step, module.current_epoch, self.last_batch, values,
                                              what="gradient"))

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, scaler=None) -> None:
        """The device verdict was this step's only: the next step's update is not conditional on it. Under fp16, a
        step skipped for an empty batch gets the loss scale (and its growth count) it had before the step, on the
        device, as if the scaler had not seen it."""
        skip_update_on_device(optimizer, None)
        kept, self.kept_scale = self.kept_scale, None
        if kept is not None and scaler is not None:
            keep, old_scale, old_growth = kept
            scale, growth = loss_scale_state(scaler)
            scale.copy_(torch.where(keep, old_scale, scale))
            growth.copy_(torch.where(keep, old_growth, growth))

    def resolve(self, module: LightningModule, wait: bool, log: bool, upto: int | None = None) -> list[tuple[int, bool]]:
        """Read the verdicts that reached the host (all of them with ``wait``; with ``upto``, exactly those of
        global steps up to it, waiting for them, and no later one even if it has arrived), oldest first: raise
        at a non-finite loss (``on_nonfinite_loss=raise``), or warn and count the skipped step. Returns
        ``(global step, usable)`` of each verdict read."""
        read = []
        while self.verdicts and (self.verdicts[0].step <= upto if upto is not None
                                 else wait or self.verdicts[0].ready()):
            record = self.verdicts.pop(0)
            finite, usable, value = record.read()
            read.append((record.step, usable))
            if usable:
                continue
            at = where(record.step, record.epoch, record.batch)
            if record.what == "gradient":
                shown = f"non-finite gradient (total norm {value}) from a finite loss"
            else:
                shown = f"non-finite loss ({value if not math.isfinite(value) else 'on another rank'})"
            if not finite and self.on_nonfinite_loss == "raise":
                self.verdicts.clear()
                raise FloatingPointError(
                    f"{shown} at {at}; its optimizer step made no update, and the run stopped "
                    "before any later checkpoint, so no checkpoint holds the result. Lower the learning rate, check "
                    "the batch, or set model.on_nonfinite_loss=skip to skip and count such steps.")
            self.rewind_schedules(module, record.step)
            if finite:
                self.count_empty_batch(at)
                continue
            self.skipped_nonfinite_steps += 1
            what = "non-finite gradient" if record.what == "gradient" else "non-finite loss"
            rank_zero_warn(f"{what} at {at}: step skipped ({self.skipped_nonfinite_steps} so far)")
        if log and self.skipped_nonfinite_steps != self.logged_nonfinite_steps:
            module.log("train/skipped_nonfinite_steps", float(self.skipped_nonfinite_steps), reduce_fx="max")
            self.logged_nonfinite_steps = self.skipped_nonfinite_steps
        return read

    def rewind_schedules(self, module: LightningModule, step: int) -> None:
        """A skipped update is no step of the learning-rate schedules either: move each per-step schedule back
        one step, once per skipped step (:func:`tasks.engine.optim.rewind_schedule`). The verdict reaches the
        host a step or two after the update, so those steps ran one step ahead of the schedule."""
        if step <= self.rewound_step:
            return
        self.rewound_step = step
        try:
            configs = module.trainer.lr_scheduler_configs
        except RuntimeError:  # not attached to a Trainer
            return
        for config in configs:
            if config.interval == "step":
                rewind_schedule(config.scheduler)

    def count_empty_batch(self, at: str) -> None:
        self.skipped_empty_batches += 1
        rank_zero_warn(f"no readable image left in the batch at {at} (on some rank): step skipped")
