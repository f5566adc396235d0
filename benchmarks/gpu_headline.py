"""The headline rows of a GPU check (scripts/gpu_check.sh) that did not run: each paper recipe's ours-vs-peer pair
timed in interleaved rounds by the suite stage (gpu_suite.json's ``interleaved`` pairs), each paper-recipe fit
(gpu_fit.json) and the demo (demo.json). One that was skipped, cut by a budget or failed (a peer with no
equivalent of the recipe aside) fails the check; they are written, named, to the file that heads summary.md.

    python benchmarks/gpu_headline.py OUT HEADLINE_MD STAGE [--allow-missing-peers]   # exit 1 if one did not run

``--allow-missing-peers`` (the CPU smoke run, ``gpu_check.sh --tiny``): a peer skipped because its library is not
installed here is not a failure.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path, name: str) -> list[dict] | None:
    path = out / name
    return json.loads(path.read_text())["rows"] if path.exists() else None


def peer_excused(row: dict, allow_missing_peers: bool) -> bool:
    """A peer that cannot be compared: no equivalent of the recipe, or (the CPU smoke run) its library missing."""
    note = row.get("note") or ""
    return row["kind"] == "peer" and ("no equivalent" in note or (allow_missing_peers and "not installed" in note))


def missing_pairs(path: Path, allow_missing_peers: bool) -> list[str]:
    """The suite's headline: each paper recipe's network against its peer in interleaved rounds (the suite's
    ``interleaved`` pairs; the single-window rows are not the headline). A paper recipe whose peer appears in the
    single-window rows but has no pair counts as missing."""
    if not path.exists():
        return [f"suite: no {path.name}"]
    data = json.loads(path.read_text())
    pairs = {g["task"]: g["rows"] for g in data.get("interleaved", []) if g["kind"] == "pair"}
    expected = set(pairs) | {r["task"] for r in data["rows"] if r["recipe"] == "paper" and r["kind"] == "peer"}
    if not expected:
        return ["suite: no interleaved ours-vs-peer pair in gpu_suite.json"]
    missing = []
    for task in sorted(expected):
        if task not in pairs:
            missing.append(f"suite: {task} paper: no interleaved ours-vs-peer pair")
            continue
        peer, ours = pairs[task]
        if peer_excused(peer, allow_missing_peers):
            continue
        missing += [f"suite: {task} {r['recipe']} {r['kind']} ({r['network']}) {r['status']}: {r.get('note') or ''}"
                    for r in (peer, ours) if r["status"] != "ok"]
    return missing


def missing_rows(out: Path, stage: str, allow_missing_peers: bool = False) -> list[str]:
    """One line per headline row of ``stage``'s files in ``out`` that did not run (``stage`` "all": every stage's)."""
    missing = []
    if stage in ("all", "suite"):
        missing += missing_pairs(out / "gpu_suite.json", allow_missing_peers)
    if stage in ("all", "fit"):
        fits = rows(out, "gpu_fit.json")
        if fits is None:
            missing.append("fit: no gpu_fit.json")
        for r in fits or []:
            if r["status"] != "ok":
                missing.append(f"fit: {r.get('task')} {r['status']}: {r.get('note') or r.get('error') or ''}")
    if stage in ("all", "demo"):
        demo = out / "demo.json"
        status = json.loads(demo.read_text()).get("status") if demo.exists() else "no demo.json"
        if status != "ok":
            missing.append(f"demo: {status}")
    return missing


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    allow = "--allow-missing-peers" in args
    out, target, stage = [a for a in args if a != "--allow-missing-peers"][:3]
    missing = missing_rows(Path(out), stage, allow)
    text = ""
    if missing:
        text = "**Headline rows that did not run (the check fails):**\n\n" + "".join(f"- {m}\n" for m in missing) + "\n"
        print("\n".join(["headline rows that did not run:", *missing]))
    Path(target).write_text(text)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
