"""How one process shares its machine: torch's intra-op threads and the loader workers it starts.

Decided once per process by :func:`plan_cpu` (the CLI applies it when the trainer knows its accelerator and
its ranks), read by every loader through :func:`loader_workers`.

Why not the defaults: torch starts one OpenMP thread per core in every process, and loader workers and the
ranks of a node each add theirs. When the threads outnumber the free cores, OpenMP's threads wait for each
other at every parallel region while the scheduler runs someone else; on the 2-core VM one busy process
beside the detection demo made its steps 9x slower (``benchmarks/bench_threads.py``). So each rank gets the
cores it may use (its CPU affinity; divided among the ranks of its node unless the launcher already bound
each rank to its own cores), its loader workers take their share (one thread each, as torch's workers run),
and the main process's threads get the rest.

Workers (``num_workers: auto``, every recipe's default):
- training on the CPU with at most 2 cores per rank: 0, loading in the main process. Worker processes only
  take CPU from the arithmetic there (the demos' measured fits: detection 370 s with 2 workers, 268 s with 0);
- otherwise on the CPU: a quarter of the rank's cores (at least 1, at most 4): CPU training consumes images
  far slower than one core decodes them;
- with an accelerator: all the rank's cores but the main process's one, at most :data:`MAX_GPU_WORKERS`:
  the paper pipelines need about 10 cores per GPU (``benchmarks/RESULTS.md``, "Training loaders").

Threads while training on the CPU (:class:`OtherLoad`): the plan counts on the rank's cores being free. When
another process takes one, a thread that shares it makes every parallel region wait for it; so a rank that
loads in its main process measures, every few seconds, the CPU time other processes spend on its cores and
runs one thread fewer per core they take, back up when they leave. (OpenMP's passive wait instead, which
also stops the wait for a busy core, made the quiet demo 1.5x slower: ``benchmarks/results_threads.md``.)

A user's choice wins: an explicit ``--data.num_workers N``, ``OMP_NUM_THREADS``, or ``SUITE_THREADS``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

#: a datamodule's ``num_workers`` argument: a count, or "auto" for :func:`plan_cpu`'s choice
NumWorkers = Union[int, Literal["auto"]]
AUTO = "auto"
#: loader workers per rank with an accelerator: enough for the paper pipelines' ~10 cores per GPU, bounded so
#: that a many-core node with one GPU does not fork a hundred copies of the dataset
MAX_GPU_WORKERS = 16
#: training on the CPU, a rank with at most this many cores loads in its main process
MAIN_PROCESS_LOADING_CORES = 2
#: the thread count :func:`apply_cpu_plan` exported, so that a later plan tells it from the user's own
PLANNED = "SUITE_PLANNED_THREADS"


@dataclass(frozen=True)
class CpuPlan:
    """Threads and loader workers of one rank. ``cores``: the cores this rank may use; ``threads``: torch's
    intra-op threads in the main process; ``workers``: loader processes per loader (one thread each)."""

    cores: int
    ranks_on_node: int
    accelerator: str
    threads: int
    workers: int
    threads_from: str  # "auto", or the setting that chose them ("OMP_NUM_THREADS", "SUITE_THREADS")
    workers_from: str  # "auto" or "num_workers"

    def describe(self) -> str:
        """One line for the run's start-up output."""
        share = f"{self.cores} cores" + (f" ({self.ranks_on_node} ranks on this node)" if self.ranks_on_node > 1 else "")
        threads = f"{self.threads} torch thread{'s' if self.threads > 1 else ''}" + \
            ("" if self.threads_from == AUTO else f" ({self.threads_from})")
        workers = (f"{self.workers} loader worker{'s' if self.workers > 1 else ''}" if self.workers
                   else "loading in the main process") + \
            (" (auto)" if self.workers_from == AUTO else "")
        return f"CPU per rank: {share}, {threads}, {workers}"


def auto_workers(cores: int, accelerator: str) -> int:
    """Loader workers for a rank with ``cores`` cores training on ``accelerator`` ("cpu", "gpu", ...)."""
    if accelerator == "cpu":
        return 0 if cores <= MAIN_PROCESS_LOADING_CORES else min(4, max(1, cores // 4))
    return max(0, min(cores - 1, MAX_GPU_WORKERS))


def plan_cpu(*, affinity: int, node_cpus: int, ranks_on_node: int, accelerator: str,
             num_workers: NumWorkers = AUTO, environ: dict | None = None) -> CpuPlan:
    """The threads and workers of one rank.

    ``affinity``: cores this process may run on (``os.sched_getaffinity``); ``node_cpus``: the node's cores.
    A process bound to fewer than all of them (SLURM's ``--cpus-per-task``, ``taskset``) owns its set; an
    unbound one shares the node with ``ranks_on_node - 1`` others. ``environ`` (default ``os.environ``):
    ``OMP_NUM_THREADS`` or ``SUITE_THREADS`` fix the threads."""
    environ = os.environ if environ is None else environ
    ranks_on_node = max(1, ranks_on_node)
    bound = affinity < node_cpus
    cores = affinity if bound else max(1, affinity // ranks_on_node)
    if num_workers == AUTO:
        workers, workers_from = auto_workers(cores, accelerator), AUTO
    else:
        workers, workers_from = check_num_workers(num_workers), "num_workers"
    for name in ("SUITE_THREADS", "OMP_NUM_THREADS"):
        value = environ.get(name, "").strip()
        if name == "OMP_NUM_THREADS" and value == environ.get(PLANNED, ""):
            continue  # exported by an earlier plan (a launching rank's), not chosen by the user
        if value:
            return CpuPlan(cores, ranks_on_node, accelerator, positive_int(environ[name], name), workers, name,
                           workers_from)
    # a worker is busy only while it loads: the main process keeps at least one core when they outnumber them
    threads = max(1, cores - workers)
    return CpuPlan(cores, ranks_on_node, accelerator, threads, workers, AUTO, workers_from)


def check_num_workers(num_workers) -> int:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be 'auto' or a count >= 0, got {num_workers!r}")
    return num_workers


def positive_int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={text!r}: the number of threads must be a whole number >= 1")
    return value


def machine_cores(cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, int]:
    """(cores this process may run on, cores of the node): its affinity, capped by the container's CPU
    quota (:func:`cgroup_cpu_limit`; a Kubernetes or Docker ``--cpus`` limit leaves the affinity at every core)."""
    node = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        affinity = node
    quota = cgroup_cpu_limit(cgroup_root)
    return (affinity if quota is None else max(1, min(affinity, quota))), node


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """The cores a CPU quota allows this process's cgroup, rounded up (``cpu.max`` of cgroup v2, or v1's
    ``cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); ``None`` without a quota or where there is no cgroup."""
    def read(path: str) -> list[str] | None:
        try:
            return Path(root, path).read_text().split()
        except (OSError, UnicodeDecodeError):
            return None

    v2 = read("cpu.max")  # "max 100000" or "<quota> <period>"
    quota_period = v2 if v2 and len(v2) == 2 else None
    if quota_period is None:
        quota, period = read("cpu/cpu.cfs_quota_us"), read("cpu/cpu.cfs_period_us")
        quota_period = [quota[0], period[0]] if quota and period else None
    if quota_period is None or quota_period[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(quota_period[0]), int(quota_period[1])
    except ValueError:
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


#: the plan :func:`apply_cpu_plan` put in force in this process
_applied: CpuPlan | None = None


def apply_cpu_plan(plan: CpuPlan) -> CpuPlan:
    """Put ``plan``'s threads in force in this process and in the processes it starts.

    ``OMP_NUM_THREADS`` is exported so that ranks Lightning launches later start with it (Lightning then
    leaves their threads alone) and OpenMP sizes their pools from the start."""
    import torch

    global _applied
    torch.set_num_threads(plan.threads)
    if plan.threads_from == AUTO:
        os.environ["OMP_NUM_THREADS"] = os.environ[PLANNED] = str(plan.threads)
    _applied = plan
    return plan


def current_plan(accelerator: str | None = None, ranks_on_node: int | None = None) -> CpuPlan:
    """The plan in force, or the one this process's machine and environment give (a datamodule used
    outside the CLI: one rank, the accelerator torch sees, or torchrun's ``LOCAL_WORLD_SIZE`` ranks)."""
    if _applied is not None:
        return _applied
    if accelerator is None:
        import torch

        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if ranks_on_node is None:
        ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    affinity, node = machine_cores()
    return plan_cpu(affinity=affinity, node_cpus=node, ranks_on_node=ranks_on_node, accelerator=accelerator)


def loader_workers(num_workers: NumWorkers) -> int:
    """The worker count a loader starts: ``num_workers`` itself, or for "auto" the plan's."""
    if num_workers == AUTO:
        return current_plan().workers
    return check_num_workers(num_workers)


class OtherLoad:
    """CPU time that other processes spend on this process's cores, in cores, between two :meth:`sample` calls.

    Reads the busy time of those cores from ``/proc/stat`` (Linux) and subtracts this process's own CPU
    time (all its threads); children still running (loader workers) would count as others, so it serves a
    process that loads in its main process. ``available`` is False where ``/proc/stat`` cannot be read."""

    def __init__(self, cpus: set[int] | None = None):
        try:
            self.cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
        except AttributeError:
            self.cpus = set()
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self.read()
        self.available = self.last is not None

    def read(self) -> tuple[float, float, float] | None:
        """(wall seconds, busy seconds of ``cpus``, this process's CPU seconds)."""
        try:
            with open("/proc/stat") as stat:
                lines = stat.read().splitlines()
        except OSError:
            return None
        busy = 0
        for line in lines:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cpus:
                ticks = [int(f) for f in fields]
                # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy
                busy += sum(ticks[:8]) - ticks[3] - ticks[4]
        own = os.times()
        return time.monotonic(), busy / self.tick, own.user + own.system

    def sample(self) -> float | None:
        """Cores' worth of CPU that others used since the last sample (None before any time has passed)."""
        now = self.read()
        if now is None or self.last is None or now[0] <= self.last[0]:
            return None
        (wall0, busy0, own0), (wall1, busy1, own1) = self.last, now
        self.last = now
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)


def threads_beside(plan: CpuPlan, others: float) -> int:
    """The plan's threads less one per core that other processes keep busy (at least one)."""
    return max(1, min(plan.threads, plan.cores - int(others + 0.5)))
