"""Kill it anywhere, get the same model: a fault campaign over the suite's tasks, on 1 and 2 processes.

For each task and process count (a *cell*) the campaign fits the task's demo recipe at its CPU size once
without a fault (the reference: 2 epochs of 3 steps, a validation each, ``last.ckpt`` every step, EMA
weights), then many times with one SIGKILL at a point drawn from the reference's own count of that point
(tests/fault_injection.py: inside a checkpoint write, before its rename, inside a validation, an all-reduce,
the process group's rendezvous, an EMA update, a backward, the first step after a resume, or at a random time
over the whole run), and
resumes each with ``--ckpt_path last``. Each fault ends in one outcome:

- ``identical``: the resumed run's ``last.ckpt`` equals the reference's bit for bit: EMA weights (its
  ``state_dict``), raw weights (``current_model_state``), the averaging state, optimizer and scheduler
  states, loops and callbacks; every few faults (``--test-every``) `test` of the resumed checkpoint also
  writes the reference's ``metrics.json``, byte for byte;
- ``refused``: the resume stopped with a clear message (no ``last.ckpt`` yet: killed before the first);
- ``failure``: anything else (it names what differed, or the end of the error);
- ``hang``: a process still alive ``--timeout`` seconds after it should have ended (for 2 processes: a
  surviving rank 60 s after its peer died).

`test` faults (``test_output``) kill `test` of the reference checkpoint between its output writers, then run
it again into the same folder, whose files must equal the reference `test`'s; an interrupted folder that
holds a ``metrics.json`` and no ``INCOMPLETE.txt`` but not the reference's files is counted as ``looks complete``
(outputs that look finished but are not). The killed `test` must exit non-zero even when the kill came after
its last collective, on a rank that writes nothing (``--points test_output:-1:1``: a negative ``n`` counts from
the end of the point's count).

Usage (the numbers in benchmarks/results_faults.md)::

    python scripts/fault_campaign.py --work /tmp/faults --jobs 1 --per-kind 4 --random 6 --until 08:55
    python scripts/fault_campaign.py --work /tmp/faults --report benchmarks/results_faults.md

The runs use a snapshot of the last commit (``git archive HEAD`` into ``<work>/tree``, made on the first start;
``--live``: the working tree as it is), so edits made while a campaign runs never reach it. Results go to
``<work>/results.<worker>.jsonl`` one fault a line, as they come, so a campaign stopped by ``--until HH:MM``
(UTC) or by hand still reports what it ran, and the same command goes on where it stopped; ``--only NAME ...``
runs the named faults of the same draw. Each run is forked from a process that imported the suite once
(``--no-fork``: a fresh interpreter each); on 2 processes Lightning's launcher starts the second rank as
``python -m tasks.<task>``.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import hashlib
import importlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TASKS = ("classify", "detect", "segment", "translate")
#: the points drawn per cell (tests/fault_injection.py); "time" is a SIGKILL from outside at a random moment
KINDS = ("step", "backward", "optimizer", "validation", "checkpoint", "rename", "ema", "allreduce", "rendezvous",
         "resume", "time", "test_output")
#: a surviving rank must be gone this long after its peer died (issue 50: 60 s or less)
PEER_BOUND_S = 60.0

FIT = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
       "--checkpoint.every_n_train_steps", "1",
       "--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging", "--trainer.callbacks.init_args.decay",
       "0.9", "--trainer.callbacks+=tests.fault_injection.FaultInjector"]
TWO = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]


def task_arguments(task: str) -> list[str]:
    """The demo recipe at its CPU size, quiet, loaders in the process (tests/test_contract.py's cells)."""
    from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY

    return [*TINY[task], *SHAPE_OVERRIDE[task], *QUIET]


def test_arguments(task: str) -> list[str]:
    from tests.test_contract import EVAL_LIMIT, QUIET, TINY

    return [*TINY[task], *QUIET, *EVAL_LIMIT[task], "--trainer.callbacks+=tests.fault_injection.FaultInjector"]


@dataclass
class Fault:
    task: str
    procs: int
    kind: str
    n: int = 0  # the point's occurrence; for "time", the delay in seconds
    rank: int = 0
    first_step: int = 0  # "resume": the step the first kill comes at
    index: int = 0
    streamed: bool = False  # read from LitData chunks (--data.streaming_root)

    @property
    def name(self) -> str:
        n = f"{self.n:.1f}s" if self.kind == "time" else self.n
        return f"{self.cell}-{self.kind}-{n}-r{self.rank}-{self.index}"

    @property
    def cell(self) -> str:
        return f"{self.task}{'-streamed' if self.streamed else ''}-p{self.procs}"


@dataclass
class Outcome:
    fault: dict
    outcome: str
    detail: str = ""
    killed: str = ""
    peer_exit_s: float | None = None
    seconds: float = 0.0
    leftovers: list = field(default_factory=list)


# -- running a command -----------------------------------------------------------------------------------------
def environment(**extra: str) -> dict[str, str]:
    from tests.conftest import clean_env

    return clean_env(OMP_NUM_THREADS="1", **extra)


class Run:
    """One ``python -m tasks.<task> ...`` in its own session, forked or started; :meth:`wait` follows its ranks."""

    def __init__(self, task: str, args: list[str], cwd: Path, env: dict, log: Path, fork: bool):
        self.log, self.started = log, time.monotonic()
        if fork:
            self.pid = os.fork()
            if self.pid == 0:
                _child(task, args, cwd, env, log)
        else:
            with open(log, "wb") as out:
                self.pid = subprocess.Popen([sys.executable, "-m", f"tasks.{task}", *args], cwd=cwd, env=env,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True).pid
        self.ranks = {0: self.pid}

    def find_ranks(self) -> None:
        for pid in _descendants(self.pid):
            rank = _env_of(pid).get("LOCAL_RANK")
            if rank is not None and rank.isdigit() and int(rank) not in self.ranks:
                self.ranks[int(rank)] = pid

    def wait(self, timeout: float, kill_at: float | None = None, kill_rank: int = 0) -> tuple[int | None, dict]:
        """The launcher's exit code (``None``: a hang, the session killed), and ``first_death``/``all_gone`` times
        (seconds after start) of the ranks. ``kill_at``: SIGKILL rank ``kill_rank`` that many seconds in."""
        code, alive, info = None, None, {}
        deadline = self.started + timeout
        while True:
            now = time.monotonic()
            if code is None:
                self.find_ranks()
                done, status = os.waitpid(self.pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
            if kill_at is not None and now - self.started >= kill_at and "sent_kill" not in info:
                victim = self.ranks.get(kill_rank)
                if victim is not None and code is None:
                    _kill(victim)
                    info["sent_kill"] = now - self.started
            living = {r for r, p in self.ranks.items() if _alive(p)}
            if alive is not None and alive - living and "first_death" not in info:
                info["first_death"] = now - self.started
            alive = living
            if code is not None and not living and not _session_alive(self.pid):
                info["all_gone"] = now - self.started
                info.setdefault("first_death", info["all_gone"])
                return code, info
            if now > deadline or ("first_death" in info and now - self.started - info["first_death"] > PEER_BOUND_S):
                info["hang"] = sorted(living)
                _kill_session(self.pid)
                if code is None:
                    os.waitpid(self.pid, 0)
                return None, info
            time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _child(task: str, args: list[str], cwd: Path, env: dict, log: Path) -> None:
    """The forked run: ``python -m tasks.<task> *args`` without starting an interpreter."""
    code = 70
    try:
        os.setsid()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = [f"tasks/{task}.py", *args]
        # Lightning's launcher starts the other ranks as ``python -m <__main__'s module>``: here, the task's
        sys.modules["__main__"].__spec__ = importlib.util.find_spec(f"tasks.{task}")
        try:
            importlib.import_module("tasks.cli.suite").main(task)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session_alive(sid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != sid:
            try:
                if os.getsid(int(entry)) == sid and _alive(int(entry)):
                    return True
            except OSError:
                pass
    return False


def _kill_session(sid: int) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    _kill(int(entry))
            except OSError:
                pass


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*") if Path(f"/proc/{parent}/task").exists() else ():
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


# -- comparing runs ------------------------------------------------------------------------------------------------
def compare_checkpoints(reference: Path, resumed: Path, roots: tuple[str, str]) -> list[str]:
    """What differs between two ``last.ckpt`` files (empty: bit-identical), every tensor with ``torch.equal``.
    Strings have the resumed run's root replaced by the reference's; the run's id and the time are skipped."""
    import torch

    a = torch.load(reference, map_location="cpu", weights_only=True)
    b = torch.load(resumed, map_location="cpu", weights_only=True)
    differences: list[str] = []
    _compare(a, b, "", differences, roots)
    return differences


#: checkpoint entries that name a run, not its state; and ModelCheckpoint's ``current_score``: the score of its
#: last save, which its ``load_state_dict`` does not restore and nothing reads (it stays ``None`` after a resume
#: until the next save)
SKIPPED = ("suite_run", "pytorch-lightning_version", "hyper_parameters", "current_score")


def _compare(a, b, where: str, out: list[str], roots: tuple[str, str]) -> None:
    import torch

    if len(out) > 8:
        return
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b)):
            out.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        keys_a = {_normalise(k, roots) for k in a}
        keys_b = {_normalise(k, roots) for k in b}
        if keys_a != keys_b:
            out.append(f"{where}: keys {sorted(map(str, keys_a ^ keys_b))[:4]}")
            return
        by_key = {_normalise(k, roots): v for k, v in b.items()}
        for key, value in a.items():
            if key in SKIPPED:
                continue
            _compare(value, by_key[_normalise(key, roots)], f"{where}/{key}", out, roots)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: length {len(a)} != {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _compare(x, y, f"{where}[{i}]", out, roots)
    elif _normalise(a, roots) != _normalise(b, roots):
        out.append(f"{where}: {a!r} != {b!r}"[:200])


def _normalise(value, roots: tuple[str, str]):
    return value.replace(roots[1], roots[0]) if isinstance(value, str) else value


def folder_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def in_child(function, *args, fork: bool = True):
    """``function(*args)`` in a forked child (the parent never starts torch's thread pools, so forking stays
    safe), its JSON-able result returned."""
    if not fork:
        return function(*args)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = {"ok": function(*args)}
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(err).__name__}: {err}"}
        with os.fdopen(write, "w") as out:
            out.write(json.dumps(result, default=str))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    os.waitpid(pid, 0)
    result = json.loads(text) if text else {"error": "the comparing process died"}
    if "error" in result:
        raise RuntimeError(result["error"])
    return result["ok"]


def optimized(task: str, work: Path) -> Path:
    """The task's demo data optimized into LitData chunks of 16 kB under ``work`` (made once)."""
    output = work / f"optimized-{task}"
    if not (output / "streaming.json").is_file():
        subprocess.run([sys.executable, "-m", "datamodules.optimize", "--task", task, "--output", str(output),
                        "--num-workers", "1", "--chunk-bytes", "16kB"], env=environment(), check=True, cwd=work,
                       capture_output=True)
    return output


def readable_checkpoint(path: Path) -> bool:
    import torch

    torch.load(path, map_location="cpu", weights_only=True)
    return True


# -- a cell: the reference and its faults ------------------------------------------------------------------------
class Cell:
    def __init__(self, task: str, procs: int, work: Path, fork: bool, timeout: float, streamed: bool = False):
        self.task, self.procs, self.fork, self.timeout = task, procs, fork, timeout
        self.streamed = streamed
        self.dir = work / Fault(task, procs, "", streamed=streamed).cell
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fit_args = [*task_arguments(task), *FIT, *(TWO if procs == 2 else [])]
        if streamed:  # training and validation read the chunks; chunks of 16 kB: a few per epoch
            self.fit_args += ["--data.streaming_root", str(optimized(task, work))]
        self.test_args = [*test_arguments(task), *(TWO if procs == 2 else [])]

    def run(self, command: str, root: str, *, fault: str | None = None, extra: tuple = (), log: str,
            kill_at: float | None = None, kill_rank: int = 0, counts: Path | None = None):
        env = {"SUITE_FAULT": fault} if fault else {}
        if counts is not None:
            env["SUITE_FAULT_COUNTS"] = str(counts)
        args = [command, *(self.fit_args if command == "fit" else self.test_args), "--trainer.default_root_dir",
                root, *extra]
        logs = self.dir / "logs"
        logs.mkdir(exist_ok=True)
        run = Run(self.task, args, self.dir, environment(**env), logs / log.replace("/", "_"), self.fork)
        code, info = run.wait(self.timeout, kill_at, kill_rank)
        return code, info, run

    def reference(self) -> dict:
        """The uninterrupted fit and `test` of its last.ckpt (run once; kept in ``reference.json``)."""
        saved = self.dir / "reference.json"
        if saved.is_file():
            return json.loads(saved.read_text())
        started = time.monotonic()
        code, _, run = self.run("fit", "straight", log="straight.log", counts=self.dir / "counts-fit")
        if code != 0:
            raise RuntimeError(f"{self.task} p{self.procs}: the reference fit failed:\n{run.text()[-3000:]}")
        seconds = time.monotonic() - started
        ckpt = str(self.dir / "straight" / "checkpoints" / "last.ckpt")
        code, _, run = self.run("test", "straight-test", extra=("--ckpt_path", ckpt), log="straight-test.log",
                                counts=self.dir / "counts-test")
        if code != 0:
            raise RuntimeError(f"{self.task} p{self.procs}: the reference test failed:\n{run.text()[-3000:]}")
        counts = {}
        for rank in range(self.procs):
            fit_counts = json.loads(Path(f"{self.dir / 'counts-fit'}.rank{rank}").read_text())
            test_counts = json.loads(Path(f"{self.dir / 'counts-test'}.rank{rank}").read_text())
            counts[str(rank)] = {**fit_counts, "test_output": test_counts["test_output"]}
        result = {"seconds": seconds, "counts": counts,
                  "test_files": folder_digest(self.dir / "straight-test" / "predictions")}
        saved.write_text(json.dumps(result, indent=1))
        return result

    def faults(self, reference: dict, kinds: list[str], per_kind: int, random_count: int, seed: int,
               points: list[str] | None = None) -> list[Fault]:
        """``per_kind`` points of each kind drawn from the reference's counts (on a random rank), and
        ``random_count`` kills at a random moment of the reference's duration; or the ``points`` given,
        ``<kind>:<n>[:<rank>]`` (``n``: the seconds for ``time``, the step of the first kill for ``resume``)."""
        if points:
            return [self.point(text, i, reference) for i, text in enumerate(points)]
        rng = random.Random(f"{seed}-{self.task}-{self.procs}")
        drawn: list[Fault] = []
        steps = reference["counts"]["0"]["step"]
        for kind in kinds:
            if kind == "time":
                continue
            for _ in range(per_kind):
                rank = rng.randrange(self.procs)
                if kind in ("checkpoint", "rename"):
                    rank = 0  # rank 0 writes the checkpoints
                if kind == "resume":
                    drawn.append(Fault(self.task, self.procs, kind, 0, rank, first_step=rng.randrange(1, steps),
                                       streamed=self.streamed))
                    continue
                count = reference["counts"][str(rank)].get(kind, 0)
                if count:
                    drawn.append(Fault(self.task, self.procs, kind, rng.randrange(count), rank, streamed=self.streamed))
        if "time" in kinds:
            for _ in range(random_count):
                drawn.append(Fault(self.task, self.procs, "time", round(rng.uniform(0, reference["seconds"]), 1),
                                   rng.randrange(self.procs), streamed=self.streamed))
        rng.shuffle(drawn)
        for i, fault in enumerate(drawn):
            fault.index = i
        return drawn

    def point(self, text: str, index: int, reference: dict) -> Fault:
        """The fault ``text`` names; a negative ``n`` counts from the end of the reference's count of that point on
        that rank (``test_output:-1:1``: after rank 1's last output writer)."""
        kind, n, *rank = text.split(":")
        if kind not in KINDS:
            raise ValueError(f"--points {text}: the kind must be one of {', '.join(KINDS)}")
        n, rank = (float(n) if kind == "time" else int(n)), int(rank[0]) if rank else 0
        if kind != "time" and n < 0:
            n += reference["counts"][str(rank)].get(kind, 0)
        if kind == "resume":
            return Fault(self.task, self.procs, kind, 0, rank, first_step=n, index=index, streamed=self.streamed)
        return Fault(self.task, self.procs, kind, n, rank, index=index, streamed=self.streamed)

    # -- one fault ------------------------------------------------------------------------------------------------
    def inject(self, fault: Fault, reference: dict, test_metrics: bool) -> Outcome:
        started = time.monotonic()
        for leftover in (self.dir / "faults").glob(f"{fault.name}*"):  # of a campaign stopped during this fault
            shutil.rmtree(leftover)
        if fault.kind == "test_output":
            outcome = self._test_fault(fault, reference)
        else:
            outcome = self._fit_fault(fault, reference, test_metrics)
        outcome.seconds = round(time.monotonic() - started, 1)
        return outcome

    def _killed(self, fault: Fault, code, info, run, root: Path) -> Outcome | None:
        """``None`` when the kill went as it should: the run ended non-zero, every rank gone in the bound,
        and its last.ckpt (if any) readable."""
        result = Outcome(asdict(fault), "", killed=f"exit {code}")
        if fault.procs == 2 and "first_death" in info and "all_gone" in info:
            result.peer_exit_s = round(info["all_gone"] - info["first_death"], 1)
        if code is None:
            result.outcome, result.detail = "hang", f"ranks {info.get('hang')} alive after the bound: {run.text()[-800:]}"
            return result
        if code == 0:
            return None if fault.kind == "time" else Outcome(asdict(fault), "failure", "the fault point was never "
                                                             "reached: the run finished", killed="exit 0")
        result.leftovers = sorted(p.name for p in (root / "checkpoints").glob("*.tmp-*")) if root.exists() else []
        last = root / "checkpoints" / "last.ckpt"
        if last.exists():
            try:
                in_child(readable_checkpoint, last)
            except RuntimeError as err:
                result.outcome, result.detail = "failure", f"last.ckpt left unreadable: {err}"
                return result
        return result

    def _resume(self, fault: Fault, root: str, log: str, resume_fault: str | None = None):
        return self.run("fit", root, fault=resume_fault, extra=("--ckpt_path", "last"), log=log)

    def _fit_fault(self, fault: Fault, reference: dict, test_metrics: bool) -> Outcome:
        root = f"faults/{fault.name}"
        point = {"resume": f"step:{fault.first_step}"}.get(fault.kind, f"{fault.kind}:{fault.n}:{fault.rank}")
        code, info, run = self.run("fit", root, fault=None if fault.kind == "time" else point, log=f"{root}.kill.log",
                                   kill_at=fault.n if fault.kind == "time" else None, kill_rank=fault.rank)
        killed = self._killed(fault, code, info, run, self.dir / root)
        if killed is not None and killed.outcome:
            return killed
        result = killed or Outcome(asdict(fault), "", killed="finished before the kill")
        if killed is None:  # a random moment after the run's end: its own last.ckpt is the result
            straight, finished = self.dir / "straight", self.dir / root
            differences = in_child(compare_checkpoints, straight / "checkpoints" / "last.ckpt",
                                   finished / "checkpoints" / "last.ckpt", (str(straight), str(finished)))
            result.outcome, result.detail = ("failure" if differences else "identical"), "; ".join(differences)
            return result
        if fault.kind == "resume":  # killed again in the first step after resuming
            code, info, run = self._resume(fault, root, f"{root}.resume1.log", f"resume:0:{fault.rank}")
            again = self._killed(fault, code, info, run, self.dir / root)
            if again is None or again.outcome:
                return again or Outcome(asdict(fault), "failure", "the resumed run was not killed in its first step")
        code, info, run = self._resume(fault, root, f"{root}.resume.log")
        text = run.text()
        if code is None:
            result.outcome, result.detail = "hang", text[-800:]
        elif code != 0:
            refused = "to resume from" in text and "there is no" in text
            result.outcome = "refused" if refused else "failure"
            result.detail = next((line for line in text.splitlines() if "there is no" in line), text[-1500:])
        else:
            straight, resumed = self.dir / "straight", self.dir / root
            differences = in_child(compare_checkpoints, straight / "checkpoints" / "last.ckpt",
                                   resumed / "checkpoints" / "last.ckpt", (str(straight), str(resumed)))
            if not differences and test_metrics:
                differences = self._metrics_differ(root, reference)
            result.outcome = "failure" if differences else "identical"
            result.detail = "; ".join(differences)
        return result

    def _metrics_differ(self, root: str, reference: dict) -> list[str]:
        ckpt = str(self.dir / root / "checkpoints" / "last.ckpt")
        code, _, run = self.run("test", f"{root}-test", extra=("--ckpt_path", ckpt), log=f"{root}.test.log")
        if code != 0:
            return [f"test of the resumed checkpoint exited {code}: {run.text()[-800:]}"]
        got = folder_digest(self.dir / f"{root}-test" / "predictions")
        return [] if got.get("metrics.json") == reference["test_files"]["metrics.json"] else ["metrics.json differs"]

    def _test_fault(self, fault: Fault, reference: dict) -> Outcome:
        root = f"faults/{fault.name}"
        ckpt = str(self.dir / "straight" / "checkpoints" / "last.ckpt")
        code, info, run = self.run("test", root, fault=f"test_output:{fault.n}:{fault.rank}", extra=("--ckpt_path", ckpt),
                                   log=f"{root}.kill.log")
        result = self._killed(fault, code, info, run, self.dir / root)
        if result is None or result.outcome:
            return result or Outcome(asdict(fault), "failure", "test was not killed")
        predictions = self.dir / root / "predictions"
        # a folder `test` has not finished holds its marker (tasks.outputs.common.INCOMPLETE); one killed after its
        # last file (a rank that writes nothing, killed after the last collective) is complete: the reference's files
        looks_complete = ((predictions / "metrics.json").is_file() and not (predictions / "INCOMPLETE.txt").is_file()
                          and folder_digest(predictions) != reference["test_files"])
        code, info, run = self.run("test", root, extra=("--ckpt_path", ckpt), log=f"{root}.again.log")
        if code != 0:
            result.outcome = "hang" if code is None else "failure"
            result.detail = f"the second test exited {code}: {run.text()[-800:]}"
            return result
        got, expected = folder_digest(predictions), reference["test_files"]
        differences = sorted(k for k in got.keys() | expected.keys() if got.get(k) != expected.get(k))
        if differences:
            result.outcome, result.detail = "failure", f"files differ from the reference test: {differences[:6]}"
        elif looks_complete:
            result.outcome = "looks complete"
            result.detail = "the interrupted folder held a metrics.json (the second test's files are the reference's)"
        else:
            result.outcome = "identical"
        return result


# -- the campaign ----------------------------------------------------------------------------------------------------
def run_worker(args) -> None:
    """Worker ``args.worker`` of ``args.jobs``: its share of the cells' faults, one JSON line each."""
    if args.fork:
        import tasks.cli.suite  # noqa: F401 - imported once, every forked run starts from here
        for task in args.tasks:
            importlib.import_module(f"tasks.{task}")
    out = args.work / f"results.{args.worker}.jsonl"
    done = {Fault(**r["fault"]).name for r in load_results(args.work)}  # a restarted campaign goes on
    stop_at = _deadline(args.until)
    cells = [Cell(task, procs, args.work, args.fork, args.timeout) for procs in args.procs for task in args.tasks]
    cells += [Cell(task, procs, args.work, args.fork, args.timeout, streamed=True) for procs in args.procs
              for task in args.streamed]
    plans = []
    for i, cell in enumerate(cells):
        if i % args.jobs == args.worker:
            try:
                reference = cell.reference()
            except RuntimeError as err:
                print(err, file=sys.stderr, flush=True)
                continue
            faults = cell.faults(reference, args.kinds, args.per_kind, args.random, args.seed, args.points)
            plans.append((cell, reference, faults))
    # round-robin over the cells, so a stopped campaign has covered every cell alike
    order = [(cell, reference, fault) for k in range(max((len(f) for _, _, f in plans), default=0))
             for cell, reference, faults in plans if k < len(faults) for fault in [faults[k]]]
    with open(out, "a") as results:
        for number, (cell, reference, fault) in enumerate(order):
            if stop_at and dt.datetime.now(dt.timezone.utc) >= stop_at:
                print(f"worker {args.worker}: --until reached after {number} faults", flush=True)
                break
            if fault.name in done or (args.only and fault.name not in args.only):
                continue
            outcome = cell.inject(fault, reference, test_metrics=args.test_every > 0 and fault.index % args.test_every == 0)
            results.write(json.dumps(asdict(outcome)) + "\n")
            results.flush()
            print(f"[{args.worker}] {fault.name}: {outcome.outcome} {outcome.detail[:200]}", flush=True)


def _deadline(until: str | None):
    if not until:
        return None
    hour, minute = map(int, until.split(":"))
    now = dt.datetime.now(dt.timezone.utc)
    stop = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return stop if stop > now else stop + dt.timedelta(days=1)


def load_results(work: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(work.glob("results.*.jsonl")) for line in path.read_text().splitlines()
            if line.strip()]


def recheck(work: Path, results: list[dict]) -> list[dict]:
    """The failures of resumed fits compared again with this version's :func:`compare_checkpoints` (a campaign
    started before a change to what is compared); those now equal become ``identical``, noted in ``detail``."""
    for result in results:
        fault = Fault(**{k: v for k, v in result["fault"].items() if k in Fault.__dataclass_fields__})
        cell = work / fault.cell
        straight, resumed = cell / "straight", cell / "faults" / fault.name
        last = resumed / "checkpoints" / "last.ckpt"
        if result["outcome"] != "failure" or fault.kind == "test_output" or not last.is_file() \
                or "metrics.json" in result["detail"]:
            continue
        differences = in_child(compare_checkpoints, straight / "checkpoints" / "last.ckpt", last,
                               (str(straight), str(resumed)))
        if not differences:
            result["outcome"], result["detail"] = "identical", f"rechecked (was: {result['detail'][:200]})"
    return results


OUTCOMES = ("identical", "refused", "looks complete", "failure", "hang")


def report(results: list[dict], command: str) -> str:
    """The markdown table: faults by kind and task, their outcomes, and the dead-peer exit times."""
    by_kind = collections.defaultdict(collections.Counter)
    by_task = collections.defaultdict(collections.Counter)
    peers = []
    for r in results:
        f = r["fault"]
        by_kind[f["kind"]][r["outcome"]] += 1
        streamed = " streamed" if f.get("streamed") else ""
        by_task[f"{f['task']}{streamed}, {f['procs']} process{'es' if f['procs'] > 1 else ''}"][r["outcome"]] += 1
        if r.get("peer_exit_s") is not None:
            peers.append(r["peer_exit_s"])

    def table(title: str, rows: dict) -> list[str]:
        lines = [f"| {title} | faults | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 2) + "|"]
        for name, counts in sorted(rows.items()):
            lines.append(f"| {name} | {sum(counts.values())} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
        total = collections.Counter()
        for counts in rows.values():
            total.update(counts)
        lines.append(f"| **all** | **{sum(total.values())}** | " + " | ".join(f"**{total[o]}**" for o in OUTCOMES) + " |")
        return lines

    lines = ["# Fault campaign: SIGKILL anywhere, resume with `--ckpt_path last`", "",
             f"{len(results)} faults. Command:", "", "```", command, "```", "",
             "What each outcome means and how the points are drawn: scripts/fault_campaign.py's docstring; the",
             "points: tests/fault_injection.py.", "", "## By task and process count", "",
             *table("task", by_task), "", "## By kind of fault", "", *table("kind", by_kind), ""]
    if peers:
        lines += ["## A dead peer rank (2 processes)", "",
                  f"The surviving rank exited {len(peers)} times after its peer was killed: median "
                  f"{sorted(peers)[len(peers) // 2]:.1f} s, at most {max(peers):.1f} s after the first rank died "
                  f"(bound: {PEER_BOUND_S:.0f} s).", ""]
    late = sum(r.get("killed") == "finished before the kill" for r in results)
    if late:
        lines += [f"{late} of the random-moment kills came after the run had ended: the complete run's own last.ckpt "
                  "is compared.", ""]
    bad = [r for r in results if r["outcome"] in ("failure", "hang", "looks complete")]
    if bad:
        lines += ["## Not identical", ""]
        for r in bad[:40]:
            f = r["fault"]
            n = f.get("first_step", 0) if f["kind"] == "resume" else f["n"]  # resume: the step of the first kill
            lines.append(f"- {f['task']}{' streamed' if f.get('streamed') else ''} p{f['procs']} {f['kind']}:{n} "
                         f"rank {f['rank']}: **{r['outcome']}** "
                         f"{r['detail'][:300]}".replace("\n", " "))
        lines.append("")
    return "\n".join(lines)


def snapshot(work: Path) -> Path:
    """The committed tree (``git archive HEAD``) in ``<work>/tree``, made on the campaign's first start and kept:
    edits to the working tree during a campaign of hours (other people's, half done) never reach its runs, and
    every fault of one ``--work`` runs the same code. Its commit is in ``<work>/tree/COMMIT``."""
    tree = work / "tree"
    if not (tree / "COMMIT").is_file():
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        partial = work / "tree.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive, check=True)
        (partial / "COMMIT").write_text(commit + "\n")
        partial.rename(tree)
    return tree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where runs, logs and results.*.jsonl go")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2], choices=[1, 2])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--streamed", nargs="*", default=["classify"], choices=TASKS,
                        help="tasks also run streamed from LitData chunks (--data.streaming_root)")
    parser.add_argument("--per-kind", type=int, default=3, help="points drawn per kind and cell")
    parser.add_argument("--random", type=int, default=4, help="kills at a random moment per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (cells are dealt out to them)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--test-every", type=int, default=4, help="`test` the resumed checkpoint of every k-th "
                        "fault and compare metrics.json (0: never)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it is a hang")
    parser.add_argument("--until", help="start no fault after this UTC time, HH:MM")
    parser.add_argument("--no-fork", dest="fork", action="store_false", help="a fresh interpreter per run")
    parser.add_argument("--live", action="store_true", help="run the working tree as it is, not the snapshot of "
                        "its last commit in <work>/tree")
    parser.add_argument("--only", nargs="+", metavar="FAULT", help="run only these faults (their names in the results)")
    parser.add_argument("--points", nargs="+", metavar="KIND:N[:RANK]", help="these faults in every cell instead of "
                        "a draw (a fault found by one campaign, run again on changed code)")
    parser.add_argument("--report", type=Path, help="write the table of <work>'s results to this file and stop")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SUITE_DATA_CACHE", str(args.work / "data-cache"))
    if args.report:
        command = (args.work / "command.txt").read_text().strip() if (args.work / "command.txt").is_file() else ""
        args.report.write_text(report(recheck(args.work, load_results(args.work)), command) + "\n")
        return
    if args.worker is not None:
        run_worker(args)
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    if not args.live and REPO != args.work / "tree":  # on to the snapshot's own copy of this script
        tree = snapshot(args.work)
        os.execv(sys.executable, [sys.executable, str(tree / "scripts" / "fault_campaign.py"), *argv])
    commit = (REPO / "COMMIT").read_text().strip() if (REPO / "COMMIT").is_file() else "the working tree"
    with open(args.work / "command.txt", "a") as commands:
        commands.write(f"python scripts/fault_campaign.py {' '.join(argv)}  # at {commit[:12]}\n")
    workers = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(i)])
               for i in range(args.jobs)]
    codes = [w.wait() for w in workers]
    print(report(load_results(args.work), (args.work / "command.txt").read_text().strip()))
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
