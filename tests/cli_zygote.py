"""A fork server for the tests' CLI runs: ``python -m tasks.<task> ...`` without paying for the imports.

Importing torch, Lightning and the suite takes 10-20 s of CPU on the 2-core VM, and the default test run
makes about a hundred CLI runs. This server imports them once per pytest process; each run is a fork of
it that becomes ``python -m tasks.<task> ...`` (``runpy``, the way ``-m`` runs a module) in its own
working folder, environment and standard streams, and exits through the interpreter's normal shutdown.
It is still a separate process per run, so nothing a run changes leaks into the next one or into pytest.

What a fork cannot give a run is what the imports themselves read from the environment (OpenMP's thread
count, ``SUITE_CPU_SPEEDUPS``, torch's own switches). :func:`can_fork_for` therefore only accepts a run
whose environment differs from the server's in variables read at run time (:data:`READ_AT_RUN_TIME`);
any other run gets a plain subprocess (``tests/conftest.py::run_task``).

Protocol, one JSON line each way on the server's stdin/stdout: the request
``{"argv", "cwd", "env", "stdin", "stdout", "stderr"}`` (file paths), then the replies ``{"pid"}`` when the
run has started and ``{"returncode"}`` when it has ended (``-N`` for a signal, as subprocess gives).
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: variables the suite, Lightning and wandb read when they run, not when they are imported: a run may set
#: them to other values than the server had
READ_AT_RUN_TIME = ("SUITE_DATA_CACHE", "SUITE_WEIGHTS_DIR", "SUITE_WEIGHTS_MIRROR", "SUITE_OFFLINE",
                    "SUITE_PREPARED_DIR", "SUITE_DEBUG", "SUITE_SYSTEM_MALLOC", "WANDB_", "PYTEST_", "HF_ENDPOINT")
#: what the server imports: what ``python -m tasks.<task> fit`` imports until it has parsed its arguments
#: seconds the server may take to import (the first run waits for it) and to fork
STARTUP_S = 600
PRELOAD = ("torch", "torchvision", "lightning.pytorch", "tasks.cli", "tasks.classify", "tasks.detect",
           "tasks.segment", "tasks.translate", "datamodules.imagefolder", "datamodules.coco",
           "datamodules.segmentation", "datamodules.wmt")


def differing(env: dict[str, str], base: dict[str, str]) -> set[str]:
    return {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}


def can_fork_for(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a run with environment ``env`` may be forked from a server started with ``base``."""
    return all(k.startswith(READ_AT_RUN_TIME) for k in differing(env, base))


class Zygote:
    """The client: one server per pytest process, started on first use. A run past its timeout is killed;
    a reply that never comes, or any other error between the two, ends the server (the next run starts another)."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote"], env=self.env,
                                     cwd=Path(__file__).resolve().parents[1], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.buffer = b""
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no reply from the CLI fork server in {timeout:.0f} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the CLI fork server exited with {self.proc.wait()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
            input: str | None = None) -> subprocess.CompletedProcess:
        try:
            if not self.ready:
                self.ready = self._reply(STARTUP_S)["ready"]
            with tempfile.TemporaryDirectory(prefix="cli-run-") as tmp:
                streams = {name: str(Path(tmp) / name) for name in ("stdin", "stdout", "stderr")}
                Path(streams["stdin"]).write_text(input or "")
                request = {"argv": argv, "cwd": str(cwd), "env": env, **streams}
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
                pid = self._reply(STARTUP_S)["pid"]
                try:
                    returncode = self._reply(timeout)["returncode"]
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)
                    self._reply(STARTUP_S)  # the server has reaped it and takes the next call
                    raise subprocess.TimeoutExpired(["python", *argv], timeout, Path(streams["stdout"]).read_text(),
                                                    Path(streams["stderr"]).read_text()) from None
                out, err = (Path(streams[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        except subprocess.TimeoutExpired:
            raise
        except BaseException:
            self.proc.kill()  # its replies may be out of step with the requests now
            self.proc.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, *argv], returncode, out, err)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def serve() -> dict | None:
    """Answer requests until stdin closes; in a forked child, return its request instead."""
    for module in PRELOAD:
        __import__(module)
    assert threading.active_count() == 1, "the server must not fork with threads running"
    channel_in, channel_out = sys.stdin, sys.stdout
    channel_out.write(json.dumps({"ready": True}) + "\n")
    channel_out.flush()
    for line in channel_in:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        channel_out.write(json.dumps({"pid": pid}) + "\n")
        channel_out.flush()
        _, status = os.waitpid(pid, 0)
        channel_out.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        channel_out.flush()
    return None


def become(request: dict) -> None:
    """In the forked child: take the run's folder, environment and streams, then run the module as ``-m``
    would; the interpreter's shutdown (atexit, thread joins, flushes) ends the process as it ends a fresh one."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, (name, mode) in enumerate([("stdin", os.O_RDONLY), ("stdout", written), ("stderr", written)]):
        os.dup2(os.open(request[name], mode, 0o644), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.path[0] = os.getcwd()  # as ``python -m`` puts the working folder first
    random.seed()  # a fresh process draws its own seed (Lightning's seed_everything(None) uses random)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    module, *args = request["argv"][1:] if request["argv"][0] == "-m" else request["argv"]
    # a fresh ``python -m`` has not imported the module it runs: the server's copy goes, so that an import of
    # it during the run (a checkpoint's class path) makes a second copy as it would there
    sys.modules.pop(module, None)
    package, _, name = module.rpartition(".")
    if package in sys.modules and hasattr(sys.modules[package], name):
        delattr(sys.modules[package], name)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    request = serve()
    if request is not None:
        become(request)
