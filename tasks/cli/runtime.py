"""Process-wide settings: the memory setting that every entry point (the four CLIs, the benchmarks)
applies before it builds anything, :class:`ThreadsFollowLoad`, the CLI's callback that gives a CPU
run's threads back to other processes while they use its cores, and :func:`cuda_speed_settings`, the
cuDNN autotuning and TF32 choice of a recipe run on CUDA.

glibc hands out each allocation above its mmap threshold (128 KiB, adapting up to 32 MiB) as a
fresh mapping and unmaps it on free, so a training step's activations come back as new pages
every step, and the kernel zeroes each page on its first touch. On the 2-core VM that took more
time than the arithmetic: a MobileViTv2-1.0 training step (batch 8, 256 px) ran 1.95 s with
glibc's defaults and 0.82 s with freed memory kept for reuse (4.4 M vs 0.6 M page faults); a 1x1
convolution writing a 67 MB map, 2.4x faster. Allocators such as jemalloc and tcmalloc keep freed
memory the same way; ``mallopt`` asks glibc for it at run time, with nothing to install.

The cost: the process holds on to its peak heap instead of returning it between steps. Set
``SUITE_SYSTEM_MALLOC=1`` to keep glibc's defaults (e.g. to compare, or on a machine short of memory).
It is one of the CPU speed paths (``benchmarks/RESULTS.md``, "CPU speed paths"): ``SUITE_CPU_SPEEDUPS=0``
turns it off with the others, and a machine with a CUDA GPU, where the suite trains on the GPU,
keeps glibc's defaults.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from layers.machine import CpuPlan, OtherLoad, current_plan, threads_beside

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: free memory at the top of the heap kept before glibc returns it (mallopt takes an int)
KEEP_FREED_BYTES = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Serve large allocations from the heap (no mapping per tensor) and keep freed memory there.

    Returns whether the setting applied: Linux with glibc and no CUDA GPU, unless ``SUITE_SYSTEM_MALLOC``
    is set or ``SUITE_CPU_SPEEDUPS=0``. Forked DataLoader workers inherit it. Safe to call more than once."""
    if (os.environ.get("SUITE_SYSTEM_MALLOC") or os.environ.get("SUITE_CPU_SPEEDUPS", "1") == "0"
            or not sys.platform.startswith("linux")):
        return False
    if torch.cuda.is_available():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


class ThreadsFollowLoad(Callback):
    """While a rank trains on the CPU and loads in its main process, its torch threads follow the cores that
    other processes leave free (:class:`layers.machine.OtherLoad`, sampled every ``interval_s`` seconds of
    training): one thread fewer per core another process keeps busy, the plan's count again once it leaves.

    Off where it cannot matter or must not: an accelerator, loader workers (their CPU time would look like
    another process's), a single planned thread, a user's own thread count, ``--trainer.deterministic``
    (a changed thread count may change the order of a float reduction), or no ``/proc/stat``."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.load: OtherLoad | None = None
        self.plan: CpuPlan | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        plan = current_plan()
        deterministic = torch.are_deterministic_algorithms_enabled()
        if (plan.accelerator != "cpu" or plan.workers or plan.threads < 2 or plan.threads_from != "auto"
                or deterministic):
            return
        self.plan, self.load = plan, OtherLoad()
        self.last_check = time.monotonic()
        if not self.load.available:
            self.load = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.load is None or time.monotonic() - self.last_check < self.interval_s:
            return
        self.last_check = time.monotonic()
        others = self.load.sample()
        if others is None:
            return
        threads = threads_beside(self.plan, others)
        if threads != torch.get_num_threads():
            rank_zero_info(f"torch threads {torch.get_num_threads()} -> {threads}: other processes use "
                           f"{others:.1f} of this rank's {self.plan.cores} cores")
            torch.set_num_threads(threads)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.plan is not None:
            torch.set_num_threads(self.plan.threads)


def cuda_speed_settings(task: str, trainer: dict) -> dict:
    """What a run on CUDA should set that Lightning leaves off, decided from the recipe's trainer section:

    - ``benchmark`` (``torch.backends.cudnn.benchmark``): on for the image tasks, which train on fixed-size crops
      (cuDNN times its convolution algorithms once per shape and keeps the fastest: what
      ``benchmarks/gpu_suite.py`` measures with); off for translation, whose token batches change shape every
      step (each new shape would be timed again), and off under ``deterministic`` (autotuning may pick a
      different algorithm per run). A recipe's own ``benchmark`` wins.
    - ``float32_matmul_precision``: ``"high"`` (TF32 tensor cores for float32 matmuls, 10-bit mantissas, as
      Lightning's hint on every such GPU run suggests) for ``32-true`` recipes (the demos); mixed-precision recipes
      run their matmuls in bf16/fp16 already and keep torch's default ``"highest"``, as does a deterministic run.

    Returns ``{"benchmark": bool | None, "float32_matmul_precision": str}`` (``None``: the recipe decided)."""
    deterministic = bool(trainer.get("deterministic"))
    benchmark = trainer.get("benchmark")
    if benchmark is None:
        benchmark = task != "translate" and not deterministic
    else:
        benchmark = None  # the recipe's, applied by Lightning
    precision = str(trainer.get("precision") or "32-true")
    tf32 = precision in ("32-true", "32") and not deterministic
    return {"benchmark": benchmark, "float32_matmul_precision": "high" if tf32 else "highest"}
