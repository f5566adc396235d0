"""Shared test set-up: no network (wandb offline, albumentations quiet), one demo-data
cache per session, and a helper that runs a task's CLI in a clean subprocess.

Under pytest-xdist (README: ``python -m pytest -n auto``) what a session builds once (the demo data, the
demo fits) is built once for all workers: the first worker that needs it builds it under a file lock
in the run's shared temporary folder, the others wait and read it."""
from __future__ import annotations

import atexit
import fcntl
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("SUITE_OFFLINE", "1")  # registered weights are never downloaded by a test (test_weights_download.py)

REPO = Path(__file__).resolve().parents[1]


def cli_threads() -> int:
    """Torch threads for a CLI run of the tests, and for a pytest-xdist worker itself: the cores shared out over
    the workers (2 cores, ``-n 2``: 1 each), so that two runs side by side never hold more threads than cores.
    OpenMP threads that wait at a barrier for a descheduled peer spin: with 2 threads per run under ``-n 2``
    the same four test files took 1.4-1.6x the wall time and 1.5-1.8x the CPU time (benchmarks/RESULTS.md, "Test run").
    ``OMP_NUM_THREADS`` set by the caller wins."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    import torch

    torch.set_num_threads(cli_threads())


def session_folder(tmp_path_factory) -> Path:
    """The test run's temporary folder, the same for every pytest-xdist worker."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build):
    """``build(folder)`` run once per test run, across pytest-xdist workers, into ``folder`` (a fresh
    ``<session folder>/<name>``); every caller gets its return value (pickled beside it)."""
    root = session_folder(tmp_path_factory)
    folder, result = root / name, root / f".{name}.result"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that arrives while another builds waits here
        if not result.exists():  # (again after a build that failed: it fails again, in this worker too)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result.write_bytes(pickle.dumps(build(folder)))
    return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session", autouse=True)
def demo_cache(tmp_path_factory) -> Path:
    """Demo datasets are built once per test run into a private cache (its builds lock out each other:
    :mod:`datamodules.demo`)."""
    path = Path(os.environ.get("SUITE_TEST_DATA_CACHE") or session_folder(tmp_path_factory) / "demo-cache")
    path.mkdir(parents=True, exist_ok=True)
    os.environ["SUITE_DATA_CACHE"] = str(path)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: distributed-launch variables removed (an
    in-process launch leaves MASTER_PORT & co behind), network-free defaults set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS",
                        # an in-process CLI run's thread plan: a subprocess must make its own
                        "SUITE_PLANNED_THREADS", "PL_SEED_WORKERS",
                        # an in-process CLI's pid for the ranks it launches (tasks/cli/preemption.py)
                        "SUITE_LAUNCHER_PID")}
    env.update({"WANDB_MODE": "offline", "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_SILENT": "true",
                "SUITE_OFFLINE": env.get("SUITE_OFFLINE", "1"),
                "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(cli_threads()))})
    env.update(extra)
    return env


_zygotes: list = []


def cli_zygote(env: dict[str, str]):
    """This pytest process's CLI fork server (started on first use), or None where ``env`` needs a fresh
    process (tests/cli_zygote.py::can_fork_for) or ``SUITE_TEST_FRESH_PROCESSES=1`` asks for one."""
    from tests.cli_zygote import Zygote, can_fork_for

    if os.environ.get("SUITE_TEST_FRESH_PROCESSES", "") not in ("", "0"):
        return None
    if not _zygotes or not _zygotes[-1].alive():
        _zygotes.append(Zygote(clean_env()))
        atexit.register(_zygotes[-1].close)
    return _zygotes[-1] if can_fork_for(env, _zygotes[-1].env) else None


def run_task(task: str, *args: str, cwd: Path, check: bool = True, timeout: float = 600, input: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m tasks.<task> *args`` in ``cwd`` with :func:`clean_env`; a non-zero exit fails
    the test with the end of the output (``check=False`` returns it instead).

    The run is a fork of a server that has imported the suite already (tests/cli_zygote.py) when its
    environment allows it, else a fresh subprocess (always with ``SUITE_TEST_FRESH_PROCESSES=1``)."""
    run_env = clean_env(**(env or {}))
    zygote = cli_zygote(run_env)
    if zygote is not None:
        proc = zygote.run(["-m", f"tasks.{task}", *args], cwd=cwd, env=run_env, timeout=timeout, input=input)
    else:
        proc = subprocess.run([sys.executable, "-m", f"tasks.{task}", *args], cwd=cwd, env=run_env,
                              capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        pytest.fail(f"tasks.{task} {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
                    f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def demo_fit(tmp_path_factory, demo_cache):
    """``demo_fit(task)`` -> the run directory (``.../runs/<task>``) of one short fit of the task's demo recipe
    (tests/test_contract.py's TINY, SHAPE_OVERRIDE, QUIET and SHORT_FIT), made once per session on first use.

    Shared by every test that only needs *a* trained checkpoint and reads it: such a test runs its own
    `test`/`predict`/`export` in its own ``tmp_path`` and must never write into this run (copy the
    checkpoint first if the command under test writes next to it)."""
    from tests.test_contract import QUIET, SHAPE_OVERRIDE, SHORT_FIT, TINY

    runs: dict[str, Path] = {}

    def fit(task: str) -> Path:
        if task not in runs:
            def build(cwd: Path) -> Path:
                run_task(task, "fit", *TINY[task], *SHAPE_OVERRIDE[task], *QUIET, *SHORT_FIT, cwd=cwd)
                return cwd / "runs" / task

            runs[task] = built_once(tmp_path_factory, f"demo-fit-{task}", build)
        return runs[task]

    return fit


@pytest.fixture(scope="session")
def classify_run(tmp_path_factory, demo_cache) -> SimpleNamespace:
    """One classification fit (tests/test_classify_cli.py's TINY: 4 steps of 16 images at 32 px, one validation
    of 2 batches) then `test` of its last.ckpt (3 batches of 16), both logging to wandb (offline), TensorBoard
    and CSV at once; made once per session for the CLI test and the media test, which only read it.

    Returns ``root`` (``runs/classify``), ``fit`` and ``test`` (their CompletedProcess), ``last`` (the
    checkpoint tested) and ``fit_wandb_runs`` (the wandb run folders there were when the fit had ended)."""
    from tests.test_classify_cli import TINY
    from tests.test_media import loggers

    import importlib.util

    def build(cwd: Path) -> SimpleNamespace:
        # without TensorBoard (a dev extra) the media test skips; the CLI test still gets its run
        names = ("wandb", "tensorboard", "csv") if importlib.util.find_spec("tensorboard") else ("wandb", "csv")
        args = [*TINY, "--data.eval_batch_size", "16", "--trainer.accelerator", "cpu", *loggers(*names)]
        fit = run_task("classify", "fit", *args, cwd=cwd)
        root = cwd / "runs" / "classify"
        fit_wandb_runs = sorted((root / "wandb").glob("offline-run-*"))
        last = next(root.rglob("last.ckpt"))
        test = run_task("classify", "test", "--ckpt_path", str(last), *args, cwd=cwd)
        return SimpleNamespace(root=root, fit=fit, test=test, last=last, fit_wandb_runs=fit_wandb_runs)

    return built_once(tmp_path_factory, "classify-run", build)


@pytest.fixture
def run_cli(tmp_path):
    """``run_cli("classify", "fit", "--trainer.max_steps", "2")`` runs the task's CLI in ``tmp_path``."""

    def run(task: str, *args: str, **kwargs):
        return run_task(task, *args, cwd=tmp_path, **kwargs)

    return run
