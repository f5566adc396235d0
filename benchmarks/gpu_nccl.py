"""What the README's "A rank that dies" relies on for NCCL, verified on one GPU: the suite's process-group timeout
and the NCCL watchdog that acts on it.

    python benchmarks/gpu_nccl.py --output OUT --budget-s 20   # on a GPU (~15 s): the three rows below
    python benchmarks/gpu_nccl.py --output OUT --tiny          # on the CPU: the first row with gloo, the others skipped

1. ``strategy``: a real one-rank ``python -m tasks.classify fit --trainer.strategy ddp`` (the demo recipe at the
   contract tests' sizes, one step) with ``process_group_probe.ProcessGroupProbe`` as a callback, which records
   on ``setup`` the process group's backend and the timeout its backend holds. Expected: ``nccl`` on a GPU
   (``gloo`` with ``--tiny``) and ``tasks.cli.sharding.COLLECTIVE_TIMEOUT``.
2. ``watchdog``: a child process makes a one-rank NCCL group with a ``STUCK_TIMEOUT_S`` timeout, queues a GPU
   kernel that spins far longer (``layers.compat.spin_cuda_stream``, as torch's distributed tests stall a stream) and an
   ``all_reduce`` behind it, then waits for the device. With ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset, as the
   suite runs (torch's default), the watchdog must end the process, non-zero, within ``MARGIN_S`` of the timeout,
   printing its timeout line.
3. ``no_handling``: the same with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, which the README says leaves a timed-out
   rank running: it must still run when its window ends (it is then killed).

Two NCCL ranks on one GPU are refused ("Duplicate GPU"), so a dead peer cannot be staged here; a collective that
cannot finish before its timeout is what the watchdog sees in both cases. The children run beside the CLI fit, so
the stage takes about the longest of them. ``--budget-s`` ends all three by then: a check the budget cut short is
``cut``, which fails as a failure does (nothing was verified). Writes ``gpu_nccl.json`` and ``gpu_nccl.md`` (the
table the GPU check puts in its summary); exits 1 if a row that ran did not hold (without ``--tiny``, a skipped
row too).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # configs and tasks, when run as a script
#: the timeout of the stuck collective's process group: short, so the watchdog acts within the stage's box
STUCK_TIMEOUT_S = 3.0
#: how long after the timeout the watchdog may take to end the process (it may first dump its flight recorder)
MARGIN_S = 30.0
#: a ``no_handling`` child still running this long after its timeout counts as left running
MIN_OBSERVED_S = 4.0
#: the child prints this line, flushed, once the all_reduce is queued behind the spinning kernel
QUEUED = "stuck collective queued"
#: the watchdog's line for a timed-out collective (ProcessGroupNCCL's "Watchdog caught collective operation
#: timeout: WorkNCCL(...) ran for 3000 milliseconds before timing out")
WATCHDOG_LINE = re.compile(r"Watchdog caught collective operation timeout|ran for \d+ milliseconds before timing out")
#: variables that change what the watchdog does with a timeout; the children run without them (torch's defaults)
HANDLING_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
                      "NCCL_BLOCKING_WAIT")
#: a launcher's leftovers that would make the one-rank fit join another job's rendezvous
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def child_env(**variables: str) -> dict[str, str]:
    """This environment for a child: the repository and benchmarks/ importable, no launcher's or error handling's
    variables, then ``variables``."""
    removed = (*HANDLING_VARIABLES, *LAUNCH_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in removed}
    env.update(WANDB_MODE="offline", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"),
                                                        os.environ.get("PYTHONPATH")])), **variables)
    return env


# -- 1. the strategy's process group ---------------------------------------------------------------------------
def strategy_row(work: Path, tiny: bool, deadline: float | None) -> dict:
    """``fit --trainer.strategy ddp`` on one device, probed; the row of check 1."""
    from configs.tasks import task_declaration
    from tasks.cli.sharding import COLLECTIVE_TIMEOUT

    probe = work / "probe.json"
    probe.unlink(missing_ok=True)
    command = [sys.executable, "-m", "tasks.classify", "fit", *task_declaration("classify").smoke_flags,
               "--data.num_workers", "0", "--trainer.accelerator", "cpu" if tiny else "gpu",
               "--trainer.devices", "1", "--trainer.strategy", "ddp", "--trainer.max_epochs", "1",
               "--trainer.limit_train_batches", "1",
               "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
               "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(work / "fit"),
               "--trainer.callbacks+=process_group_probe.ProcessGroupProbe",
               "--trainer.callbacks.init_args.output", str(probe)]
    expected = {"backend": "gloo" if tiny else "nccl", "timeout_s": COLLECTIVE_TIMEOUT.total_seconds()}
    row = {"check": "strategy", "command": " ".join(["python", *command[1:]]), "expected": expected}
    timeout = 600 if deadline is None else deadline - time.monotonic()
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=work, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "status": "cut", "note": f"the fit ran past the budget ({timeout:.0f} s)"}
    row["wall_s"] = round(time.monotonic() - start, 1)
    if not probe.exists():
        return {**row, "status": "failed", "note": f"exit {proc.returncode}, no probe: {tail(proc.stderr)}"}
    row["observed"] = observed = json.loads(probe.read_text())
    wrong = [f"{key} {observed.get(key)!r}, expected {value!r}"
             for key, value in (("backend", expected["backend"]),
                                ("process_group_timeout_s", expected["timeout_s"]),
                                ("strategy_timeout_s", expected["timeout_s"]))
             if observed.get(key) != value]
    if proc.returncode != 0:
        wrong.append(f"exit {proc.returncode}: {tail(proc.stderr)}")
    return {**row, "status": "failed" if wrong else "ok", "note": "; ".join(wrong)}


# -- 2. and 3. a collective stuck past its timeout -------------------------------------------------------------
def stuck_child(timeout_s: float, spin_s: float, store: str) -> None:
    """The child of checks 2 and 3: an all_reduce queued behind a kernel that spins ``spin_s`` seconds, in a
    one-rank NCCL group whose timeout is ``timeout_s``; waits for the device (the watchdog ends it first)."""
    import torch
    import torch.distributed as dist

    from layers.compat import spin_cuda_stream

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file from the abort that the watchdog's teardown is
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # the spin is counted in clock cycles: time how many make a second on this GPU between two CUDA events (the
    # calibration torch's own test utilities do)
    spin_cuda_stream(1000)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    spin_cuda_stream(100_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_s = 100_000_000 / (begin.elapsed_time(end) / 1e3)
    dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s), device_id=device)
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)  # a collective that completes: NCCL itself works
    torch.cuda.synchronize()
    spin_cuda_stream(int(spin_s * cycles_per_s))
    dist.all_reduce(probe)  # waits on the stream behind the spinning kernel: past its timeout
    print(f"{QUEUED} ({cycles_per_s / 1e9:.2f} G cycles/s, a {spin_s:.0f} s spin)", flush=True)
    torch.cuda.synchronize()
    print("the device finished: nothing ended the stuck collective", flush=True)
    dist.destroy_process_group()


def watch_stuck_child(work: Path, name: str, env: dict, window_s: float, deadline: float | None,
                      command: list[str] | None = None) -> dict:
    """Runs the stuck child (``command``, by default ``python gpu_nccl.py --stuck-child ...``) with ``env`` until
    it exits or ``window_s`` has passed since it printed :data:`QUEUED` (or the ``deadline``), then kills it.
    Returns ``{queued, exit_code (None: killed), seconds (from the queued collective to the exit or kill), cut,
    watchdog_line, stderr_tail}``."""
    store = work / f"{name}.store"
    store.unlink(missing_ok=True)
    command = command or [sys.executable, str(Path(__file__).resolve()), "--stuck-child", "--store", str(store)]
    with open(work / f"{name}.out", "w+") as out, open(work / f"{name}.err", "w+") as err:
        child = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=err)
        queued, killed = None, False
        while child.poll() is None:
            now = time.monotonic()
            if queued is None and QUEUED in (work / f"{name}.out").read_text():
                queued = now
            if (queued is not None and now - queued > window_s) or (deadline is not None and now > deadline):
                child.kill()
                child.wait()
                killed = True
                break
            time.sleep(0.05)
        else:
            if queued is None and QUEUED in (work / f"{name}.out").read_text():
                queued = time.monotonic()  # queued and ended between two looks
        ended = time.monotonic()
        err.seek(0)
        stderr = err.read()
    found = next((line.strip() for line in stderr.splitlines() if WATCHDOG_LINE.search(line)), None)
    return {"queued": queued is not None, "exit_code": None if killed else child.returncode,
            "seconds": round(ended - queued, 1) if queued is not None else None,
            "cut": killed and (queued is None or ended - queued < window_s), "watchdog_line": found,
            "stderr_tail": tail(stderr)}


def not_queued(row: dict) -> dict:
    """The row of a child that never queued its stuck collective: cut by the budget, or failed before (NCCL's
    start, the GPU), with its stderr's end."""
    if row["cut"]:
        return {**row, "status": "cut", "note": "the budget ended before the child queued its collective"}
    return {**row, "status": "failed", "note": f"exit {row['exit_code']} before its collective queued: "
                                               f"{row['stderr_tail'][-400:]}"}


def watchdog_row(watch: dict) -> dict:
    """Check 2 (torch's default handling): the child ended itself, non-zero, printing the watchdog's line."""
    row = {"check": "watchdog", "handling": "unset (torch's default)", **watch}
    if not watch["queued"]:
        return not_queued(row)
    if watch["exit_code"] is None:
        return {**row, "status": "cut" if watch["cut"] else "failed",
                "note": f"still running {watch['seconds']} s after the collective queued (timeout {STUCK_TIMEOUT_S} s)"}
    wrong = [] if watch["exit_code"] != 0 else ["exit 0"]
    if watch["watchdog_line"] is None:
        wrong.append("no watchdog timeout line on stderr")
    return {**row, "status": "failed" if wrong else "ok", "note": "; ".join(wrong)}


def no_handling_row(watch: dict) -> dict:
    """Check 3 (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``): the child was still running well past its timeout."""
    row = {"check": "no_handling", "handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING=0", **watch}
    if not watch["queued"]:
        return not_queued(row)
    if watch["exit_code"] is not None:
        return {**row, "status": "failed",
                "note": f"exited {watch['exit_code']} {watch['seconds']} s after its collective queued"}
    if watch["seconds"] - STUCK_TIMEOUT_S < MIN_OBSERVED_S:
        return {**row, "status": "cut", "note": "the budget ended before the child was watched past its timeout"}
    return {**row, "status": "ok", "note": ""}


def torch_defaults() -> dict:
    """The installed torch's defaults the README relies on: the NCCL timeout, and TORCH_NCCL_ASYNC_ERROR_HANDLING
    (not readable from Python: read from the comment over it in the installed ProcessGroupNCCL.hpp)."""
    import torch
    from torch.distributed.constants import default_pg_nccl_timeout

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    text = header.read_text() if header.exists() else ""
    documented = re.search(r"default value \((\d+) - (\w+)\)", text)
    return {"torch": torch.__version__,
            "default_pg_nccl_timeout_s": default_pg_nccl_timeout.total_seconds() if default_pg_nccl_timeout else None,
            "async_error_handling_env": {name: os.environ.get(name, "unset") for name in HANDLING_VARIABLES},
            "async_error_handling_default": f"{documented[1]} ({documented[2]}), from {header.name}'s comment"
            if documented else f"not found in {header}"}


def tail(text: str, chars: int = 1500) -> str:
    return text[-chars:].strip()


# -- the report -----------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    defaults = report["torch_defaults"]
    lines = [f"NCCL timeout and watchdog, {report['machine']}; torch {defaults['torch']}: "
             f"default_pg_nccl_timeout {defaults['default_pg_nccl_timeout_s']} s, TORCH_NCCL_ASYNC_ERROR_HANDLING "
             f"here {defaults['async_error_handling_env']['TORCH_NCCL_ASYNC_ERROR_HANDLING']}, default "
             f"{defaults['async_error_handling_default']}", "",
             "| check | expected | observed | status |", "| --- | --- | --- | --- |"]
    for row in report["rows"]:
        if row["check"] == "strategy":
            seen = row.get("observed", {})
            what = (f"`fit --trainer.strategy ddp`, 1 rank: the process group's backend and timeout",
                    f"{row['expected']['backend']}, {row['expected']['timeout_s']:.0f} s (COLLECTIVE_TIMEOUT)",
                    f"{seen.get('backend', '-')}, {seen.get('process_group_timeout_s', '-')} s "
                    f"({seen.get('strategy', '-')}: {seen.get('strategy_timeout_s', '-')} s)")
        elif row["status"] == "skipped":
            what = (row["check"], "-", "-")
        else:
            expected = (f"exit != 0 within {MARGIN_S:.0f} s of the timeout, the watchdog's line"
                        if row["check"] == "watchdog" else f"still running {MIN_OBSERVED_S:.0f}+ s after the timeout")
            ending = "killed" if row["exit_code"] is None else f"exit {row['exit_code']}"
            seen = (f"{ending} {row['seconds']} s after it queued; {(row['watchdog_line'] or 'no watchdog line')[-300:]}"
                    if row["queued"] else ending)
            what = (f"a collective stuck past its {STUCK_TIMEOUT_S:.0f} s timeout, {row['handling']}", expected, seen)
        status = row["status"] + (f": {row['note']}" if row.get("note") else "")
        lines.append("| " + " | ".join(cell.replace("|", "/").replace("\n", " / ") for cell in (*what, status)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/gpu_results"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_nccl"))
    parser.add_argument("--tiny", action="store_true", help="CPU: the strategy check with gloo, the others skipped")
    parser.add_argument("--budget-s", type=float, default=0.0, help="end every check by then (0: no budget)")
    parser.add_argument("--stuck-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stuck_child:
        stuck_child(STUCK_TIMEOUT_S, STUCK_TIMEOUT_S + MARGIN_S + 30, args.store)
        return 0
    import torch

    deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else None
    args.work.mkdir(parents=True, exist_ok=True)
    args.output.mkdir(parents=True, exist_ok=True)
    nccl = not args.tiny and torch.cuda.is_available() and torch.distributed.is_nccl_available()
    window = STUCK_TIMEOUT_S + MARGIN_S
    with ThreadPoolExecutor(3) as pool:  # the stuck children beside the fit: they wait on the GPU, not the CPU
        if nccl:
            default = pool.submit(watch_stuck_child, args.work, "watchdog", child_env(), window, deadline)
            no_handling = pool.submit(watch_stuck_child, args.work, "no_handling",
                                      child_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"), window, deadline)
        rows = [strategy_row(args.work, args.tiny, deadline)]
        if nccl:
            rows += [watchdog_row(default.result()), no_handling_row(no_handling.result())]
        else:
            skipped = "needs CUDA (NCCL)" + (": --tiny" if args.tiny else ": none here")
            rows += [{"check": check, "status": "skipped", "note": skipped} for check in ("watchdog", "no_handling")]
    machine = torch.cuda.get_device_name() if nccl else "CPU" + (" (--tiny)" if args.tiny else "")
    report = {"machine": machine, "torch_defaults": torch_defaults(), "stuck_timeout_s": STUCK_TIMEOUT_S,
              "margin_s": MARGIN_S, "rows": rows}
    (args.output / "gpu_nccl.json").write_text(json.dumps(report, indent=1))
    (args.output / "gpu_nccl.md").write_text(markdown(report))
    print(markdown(report))
    print(json.dumps(report, indent=1))  # the whole report in the log: the GPU check keeps only the table
    held = {"ok"} | ({"skipped"} if args.tiny else set())
    return 0 if all(row["status"] in held for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
