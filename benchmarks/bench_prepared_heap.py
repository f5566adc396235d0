"""What a prepared-index build leaves resident, with and without handing the freed heap back.

A build parses a whole annotation file into Python objects and keeps only flat arrays; under the suite's
keep-freed-memory malloc setting (tasks/cli/runtime.py) the parse's freed heap would stay resident for the
whole run. ``datamodules.prepared`` calls ``malloc_trim`` after a build; this script measures a build of a
1.5 M-object JSON file with that call (``on``) and without it (``off``), in alternating fresh processes.

    python benchmarks/bench_prepared_heap.py
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile

BLOB = os.path.join(tempfile.gettempdir(), "bench_prepared_heap.json")


def measure(trim: str) -> str:
    import numpy as np

    import datamodules.prepared as prepared
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()
    if trim == "off":
        prepared._release_freed_heap = lambda: None  # the one thing this measurement turns off

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    base = resident_mb()

    def build():
        with open(BLOB) as f:
            objects = json.load(f)["a"]
        return {"ids": np.array([o["id"] for o in objects])}, {}

    prepared.prepare("heap-check", tempfile.mkdtemp(), {"n": 1}, build, tempfile.mkdtemp())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"trim {trim}: kept {resident_mb() - base:.0f} MB after the build (peak RSS {peak:.0f} MB)"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        print(measure(sys.argv[2]))
        return
    if not os.path.exists(BLOB):
        with open(BLOB, "w") as f:
            json.dump({"a": [{"id": i, "bbox": [1.0, 2.0, 3.0, 4.0], "name": f"x{i}"} for i in range(1_500_000)]}, f)
    for trim in ("off", "on", "off", "on"):
        print(subprocess.run([sys.executable, __file__, "--run", trim], check=True, capture_output=True,
                             text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
