"""Where embedded demo datasets live, and how they are built once.

Each task's demo set is written from installed packages (scikit-learn's digits,
pycountry/babel translations) into a cache directory, in the real benchmark's
on-disk layout, then read by the same code that reads the real dataset.

The cache is ``$SUITE_DATA_CACHE`` or ``~/.cache/visionlang-suite``. A build
writes into a temporary sibling and renames it into place, so a crashed or
concurrent build (several DDP ranks) never leaves a half-written dataset behind.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_home() -> Path:
    return Path(os.environ.get("SUITE_DATA_CACHE", Path.home() / ".cache" / "visionlang-suite"))


def demo_root(name: str, build: Callable[[Path], None], version: int = 1) -> Path:
    """Return the directory of demo dataset ``name``, calling ``build(tmp_dir)`` once if absent.

    ``version`` is part of the directory name: bump it when the generator changes so
    stale caches are rebuilt instead of silently reused.
    """
    home = cache_home()
    home.mkdir(parents=True, exist_ok=True)
    root = home / f"{name}-v{version}"
    if root.is_dir():
        return root
    with open(home / f".{name}-v{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait here while one builds
        if root.is_dir():
            return root
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=home))
        try:
            build(tmp)
            os.replace(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return root
