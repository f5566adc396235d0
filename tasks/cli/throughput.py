"""How fast ``fit`` trains, and whether the device waits for data: :class:`Throughput`, the callback the CLI
installs on every ``fit`` (``--throughput false`` leaves it out).

It measures three things on the host, with ``time.perf_counter`` and the shapes of the batch's tensors (host
metadata: nothing is read from the device, so a training step gains no host-device synchronisation):

- **samples/s**, per device and in total (per device x world size): images for the image tasks; for
  translation the source and target tokens of the batch, counted with their padding from the tensors'
  shapes (the tokens the device computes on; the real ones would have to be read from the device);
- **data wait**, the share of the step time the host spent between the end of one training step
  (``on_train_batch_end``) and the start of the next (``on_train_batch_start``), where Lightning calls the
  loader's ``next()`` and moves the batch to the device: timm's, torchvision's and mmengine's ``data_time``
  against the whole step. On a GPU the host queues a step's kernels and runs ahead of the device, so this is
  the time the host waited for data; while the host waits nothing new is queued, and when the share is large
  the GPU starves. A few other things run in that gap too: Lightning reads the logged values every
  ``log_every_n_steps`` steps (on a GPU that read waits for the queued work), and the progress bar prints.
  A step whose gap holds a validation, a checkpoint write or an epoch boundary is left out of every number,
  and so is the first step of the fit (start-up, compilation);
- **MFU** (model FLOPs utilisation) where both the FLOPs and the device's peak are known: the training step
  counts as 3x the forward FLOPs (forward, and backward at twice the forward), the forward FLOPs being the
  suite's count (:mod:`tasks.engine.cost`, ``TaskModule.model_cost()``: ``gflops`` of one sample at the
  evaluation size) scaled to the batch by its pixels (image tasks) or tokens (translation), linearly (the
  quadratic part of attention is not rescaled); MFU = achieved FLOP/s per device / the device's peak dense
  FLOP/s for the training precision (:data:`PEAK_TFLOPS`). A CPU or an unlisted device shows no MFU.

Where it shows: every ``log_every_n_steps`` steps the loggers get ``train/throughput`` (samples/s, all
devices), ``train/throughput_per_device``, ``train/data_wait`` (a fraction) and ``train/mfu`` (when known),
over the steps since the last report; the progress bar (Rich, or the plain lines of
:class:`tasks.cli.progress.LineProgress`) shows the rate and the wait; and at the end of ``fit`` one line::

    throughput: 812 images/s (406 per device), the loader kept the host waiting 3.0 % of the step time

The values go to the loggers directly (``logger.log_metrics`` on rank 0), not through
``LightningModule.log``, which turns a Python float into a tensor on the module's device: a blocking
host-to-device copy on a GPU. The plain-line progress (:class:`tasks.cli.progress.LineProgress`, used whenever
the output is not a terminal, as in a cluster job's log) appends them to its lines; Rich's bar on a terminal
shows the loggers' values only through the loggers (Lightning offers no public way to add a value to its bar
that is not logged through ``LightningModule.log``).

Why not Lightning's ``ThroughputMonitor``: it calls ``torch.cuda.synchronize()`` after every training batch
(to time the device exactly), which is the host-device sync this suite keeps out of a training step; it
needs the FLOPs per batch given up front (one number, while the suite's batches change size) and does not
measure the loader's share. Why not Lightning's ``get_available_flops`` for the peaks: its H200 entries are
the datasheet's figures with sparsity (twice the dense peak), the plain ``NVIDIA H200`` name (the SXM part)
and the A10 are not recognised, and the RTX 4090's bf16 entry is its FP32 rate; devices this table does
not list still fall back to it.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

#: peak dense tensor-core throughput in TFLOP/s (no sparsity) by training dtype; "tf32" is float32 matmuls
#: on tensor cores (used when ``torch.get_float32_matmul_precision()`` is not "highest" on Ampere or later).
#: Sources, NVIDIA's datasheets: A100 (nvidia-a100-datasheet-us-nvidia-1758950-r4), H100 and H200 (the
#: H100 Tensor Core GPU datasheet; hpc-datasheet-sc23-h200: the figures marked "with sparsity" halved),
#: V100 (volta-v100-datasheet-update-us-1165301-r5), L4 (nvidia-l4-datasheet: sparse figures halved),
#: A10 (a10-datasheet: sparse figures halved), RTX 4090 (Ada architecture whitepaper v2.1, appendix: FP16/BF16
#: tensor with FP32 accumulate, dense). Matched by a substring of ``torch.cuda.get_device_name``, in order.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200 nvl", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.7, "fp32": 67.0}),
    ("h100 nvl", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h100 pcie", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("h100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("H100 80GB HBM3")
    ("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("v100s", {"fp16": 130.0, "fp32": 16.4}),
    ("v100-pcie", {"fp16": 112.0, "fp32": 14.0}),
    ("v100", {"fp16": 125.0, "fp32": 15.7}),  # SXM2
    ("l40", {}),  # before "l4": left to Lightning's table
    ("l4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("a10g", {}),  # the AWS part, not the A10: left to Lightning's table
    ("a10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("rtx 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
)


def training_dtype(precision: str | None) -> str:
    """The dtype a Trainer ``precision`` computes its matmuls in: "bf16", "fp16" or "fp32"."""
    precision = str(precision or "32-true")
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "fp32"


def peak_flops(device: torch.device, precision: str | None) -> float | None:
    """The device's peak dense FLOP/s for ``precision``, or ``None`` (a CPU, an unknown GPU, a dtype it lacks)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = training_dtype(precision)
    if dtype == "fp32" and torch.cuda.get_device_capability(device) >= (8, 0) \
            and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    for key, peaks in PEAK_TFLOPS:
        if key in name.lower():
            if peaks:
                return peaks[dtype] * 1e12 if dtype in peaks else None
            break
    from lightning.fabric.utilities.throughput import get_available_flops

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown device: no MFU, said once in the summary
        flops = get_available_flops(device, torch_dtype[dtype])
    return float(flops) if flops else None


def batch_size(batch: Any) -> tuple[int, int, str]:
    """``(samples, size units, unit name)`` of a training batch, from its tensors' shapes alone: images and
    their pixels for an image batch, padded source + target tokens (both) for a translation batch."""
    if isinstance(batch, dict):
        image = batch.get("image")
        if isinstance(image, torch.Tensor) and image.dim() == 4:
            return image.shape[0], image.shape[0] * image.shape[-2] * image.shape[-1], "images"
        src, tgt = batch.get("src"), batch.get("tgt_in", batch.get("tgt_out"))
        if isinstance(src, torch.Tensor) and isinstance(tgt, torch.Tensor):
            tokens = src.numel() + tgt.numel()
            return tokens, tokens, "tokens"
        return 0, 0, "samples"  # e.g. a batch whose images were all unreadable: {"skipped": n}
    if isinstance(batch, torch.Tensor):
        return batch.shape[0], batch.shape[0], "samples"
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].shape[0], batch[0].shape[0], "samples"
    return 0, 0, "samples"


def example_units(example: Any) -> int | None:
    """The size units (pixels or tokens, as :func:`batch_size`) of the one-sample input FLOPs are counted on."""
    if isinstance(example, torch.Tensor) and example.dim() == 4:
        return example.shape[-2] * example.shape[-1]
    if isinstance(example, (list, tuple)) and len(example) == 2 and all(isinstance(t, torch.Tensor) for t in example):
        return sum(t.numel() for t in example)  # translation: (src, tgt_in) of one sentence pair
    return None


class Window:
    """Counted steps: samples, size units, wait and whole step time (seconds)."""

    def __init__(self):
        self.steps = self.samples = self.units = 0
        self.wait = self.time = 0.0

    def add(self, samples: int, units: int, wait: float, busy: float) -> None:
        self.steps += 1
        self.samples += samples
        self.units += units
        self.wait += wait
        self.time += wait + busy


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _percent(fraction: float) -> str:
    value = 100 * fraction
    return f"{value:.0f} %" if value >= 10 or value == 0 else f"{value:.1f} %"


class Throughput(Callback):
    """samples/s, the loader's share of the step time and MFU during ``fit`` (see the module's docstring).

    Args:
        clock: the host clock in seconds (``time.perf_counter``; tests give their own).
    """

    def __init__(self, clock: Callable[[], float] | None = None):
        self.clock = clock or time.perf_counter
        self.unit = "samples"
        self.world_size = 1
        self.flops_per_unit: float | None = None  # forward FLOPs per pixel / token
        self.peak: float | None = None
        self.total = Window()
        self.window = Window()
        self.summary: str | None = None
        self.last: dict[str, float] = {}
        self._last_end: float | None = None
        self._start: float | None = None
        self._pending: tuple[int, int, float] | None = None  # this step's samples, units, wait
        self._logged_step = -1

    # -- set-up ----------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.world_size = max(int(trainer.world_size), 1)
        self.total, self.window, self.last, self.summary = Window(), Window(), {}, None
        self._last_end = None
        self._logged_step = trainer.global_step
        self.peak = peak_flops(trainer.strategy.root_device, trainer.precision) if trainer.is_global_zero else None
        if self.peak is not None:
            self.flops_per_unit = self.forward_flops_per_unit(pl_module)

    @staticmethod
    def forward_flops_per_unit(pl_module) -> float | None:
        """The model's forward FLOPs per pixel (token) at its FLOP-counting input, or None when unknown."""
        cost = getattr(pl_module, "model_cost", None)
        units = example_units(getattr(pl_module, "example_input_array", None))
        if cost is None or not units:
            return None
        try:
            gflops = cost().get("gflops")
        except Exception as error:  # e.g. a compiled network the counter cannot run
            rank_zero_info(f"throughput: no MFU, the model's FLOPs could not be counted ({error})")
            return None
        return gflops * 1e9 / units if gflops else None

    # -- the steps -------------------------------------------------------------------------------
    def _interrupt(self, *args, **kwargs) -> None:
        """The next step's gap holds something other than the loader: leave that step out."""
        self._last_end = None

    on_train_epoch_start = on_train_epoch_end = on_validation_start = on_validation_end = _interrupt

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._last_end = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = self.clock()
        samples, units, unit = batch_size(batch)
        if samples:
            self.unit = unit
        self._pending = None if self._last_end is None else (samples, units, now - self._last_end)
        self._start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = self.clock()
        if self._pending is not None and self._start is not None:
            samples, units, wait = self._pending
            busy = now - self._start
            self.total.add(samples, units, wait, busy)
            self.window.add(samples, units, wait, busy)
        self._pending = None
        self._last_end = now
        step = trainer.global_step
        every = trainer.log_every_n_steps
        if every and step % every == 0 and step != self._logged_step and trainer.is_global_zero:
            self._logged_step = step
            self.report(trainer)
            self._last_end = self.clock()  # the report's own time is no step's: the next gap starts after it

    def metrics(self, window: Window) -> dict[str, float]:
        """The logged values over ``window`` (empty when it counted no time)."""
        if window.time <= 0:
            return {}
        per_device = window.samples / window.time
        values = {"train/throughput": per_device * self.world_size, "train/throughput_per_device": per_device,
                  "train/data_wait": window.wait / window.time}
        if self.peak and self.flops_per_unit:
            values["train/mfu"] = 3 * self.flops_per_unit * window.units / window.time / self.peak
        return values

    def report(self, trainer) -> None:
        values = self.metrics(self.window)
        self.window = Window()
        if not values:
            return
        self.last = values
        # the step Lightning's own logging gives this step's values (the optimizer steps before it), so that
        # the rows line up and a logger that wants increasing steps (wandb) keeps them
        step = max(trainer.global_step - 1, 0)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    def progress_items(self) -> dict[str, str]:
        if not self.last:
            return {}
        unit = {"images": "img/s", "tokens": "tok/s"}.get(self.unit, "samples/s")
        return {unit: _rate(self.last["train/throughput"]), "data wait": _percent(self.last["train/data_wait"])}

    def progress_text(self) -> str:
        """``812 img/s, data wait 3 %`` for a plain progress line ('' before the first report)."""
        return ", ".join(f"{v} {k}" if k != "data wait" else f"{k} {v}" for k, v in self.progress_items().items())

    # -- the end ---------------------------------------------------------------------------------
    def summary_line(self) -> str:
        """The line printed at the end of ``fit`` over every counted step."""
        values = self.metrics(self.total)
        if not values:
            return "throughput: not measured (no training step after the first)"
        line = f"throughput: {_rate(values['train/throughput'])} {self.unit}/s"
        if self.world_size > 1:
            line += f" ({_rate(values['train/throughput_per_device'])} per device)"
        line += f", the loader kept the host waiting {_percent(values['train/data_wait'])} of the step time"
        if "train/mfu" in values:
            line += f", MFU {_percent(values['train/mfu'])}"
        return line

    def on_train_end(self, trainer, pl_module) -> None:
        self.summary = self.summary_line()
        rank_zero_info(self.summary)
