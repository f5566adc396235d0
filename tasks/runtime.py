"""Process-wide CPU memory setting that every entry point (the four CLIs, the benchmarks) applies
before it builds anything.

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
    import torch

    if torch.cuda.is_available():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
