"""The headline rows of a GPU check (scripts/gpu_check.sh) that did not run: each paper recipe's eager ours-vs-peer
pair of the suite stage (gpu_suite.json), each paper-recipe fit (gpu_fit.json) and the demo (demo.json). One that
was skipped, cut by a budget or failed (a peer with no equivalent of the recipe aside) fails the check; they are
written, named, to the file that heads summary.md.

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


def missing_rows(out: Path, stage: str, allow_missing_peers: bool = False) -> list[str]:
    """One line per headline row of ``stage``'s files in ``out`` that did not run (``stage`` "all": every stage's)."""
    missing = []
    if stage in ("all", "suite"):
        suite = rows(out, "gpu_suite.json")
        if suite is None:
            missing.append("suite: no gpu_suite.json")
        for r in suite or []:
            note = r.get("note") or ""
            no_peer = r["kind"] == "peer" and ("no equivalent" in note
                                               or (allow_missing_peers and "not installed" in note))
            if r["compile"] == "off" and r["kind"] in ("ours", "peer") and r["status"] != "ok" and not no_peer:
                missing.append(f"suite: {r['task']} {r['recipe']} {r['kind']} ({r['network']}) {r['status']}: "
                               f"{r.get('note') or ''}")
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
