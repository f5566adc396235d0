"""First-start cost of a WMT training split: the per-line path of commit 0c8872d against the prepared index.

    python benchmarks/bench_wmt_prepare.py [--pairs 200000] [--words 26] [--folder /tmp/wmt-bench]

Writes a parallel corpus of ``pairs`` lines of about ``words`` words drawn from a Zipfian vocabulary
(once, in ``folder``), trains its sentencepiece model (once, cached beside it), then runs each path
in a fresh Python process and prints its CPU time (user + system, all threads), wall time, peak RSS
and the RSS it keeps after loading (``resource.getrusage`` and ``/proc/self/statm``):

- ``old``: ``ParallelText`` of ``datamodules/wmt.py`` at commit 0c8872d (read from git), which reads
  both files into lists, encodes them line by line into lists and keeps one numpy array per line;
- ``prepared, first start``: :func:`datamodules.wmt.prepare_split` building the index in an empty
  prepared folder, then :class:`datamodules.wmt.ParallelText` on it;
- ``prepared, later start``: the same with the index already there (mapped, not built).

It takes minutes and gigabytes at full size.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

OLD_COMMIT = "0c8872d"
REPO = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, pairs: int, words: int, seed: int = 0) -> tuple[Path, Path]:
    """``train.en``/``train.de``: sentences of 0.5-1.5 x ``words`` words, Zipf-distributed over 50k
    made-up words per side (the German side spells each word differently)."""
    src, tgt = folder / "train.en", folder / "train.de"
    if src.is_file() and tgt.is_file():
        return src, tgt
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, size=rng.integers(2, 11))) for _ in range(50_000)]
    german = [word[::-1].capitalize() + "e" for word in vocabulary]
    with open(src, "w", encoding="utf-8") as en, open(tgt, "w", encoding="utf-8") as de:
        for _ in range(pairs):
            picks = np.minimum(rng.zipf(1.1, size=rng.integers(words // 2, words * 3 // 2 + 1)), 50_000) - 1
            en.write(" ".join(vocabulary[i] for i in picks) + "\n")
            de.write(" ".join(german[i] for i in picks) + "\n")
    return src, tgt


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(path: str, src: Path, tgt: Path, model: Path, prepared: Path) -> dict:
    """Run one path in this process; its costs as a dict."""
    from datamodules import wmt
    from datamodules.tokenizer import Tokenizer

    old = types.ModuleType("old_wmt")  # defined (and its imports loaded) before the clock starts
    exec(subprocess.run(["git", "show", f"{OLD_COMMIT}:datamodules/wmt.py"], cwd=REPO, check=True,
                        capture_output=True, text=True).stdout, old.__dict__)
    tokenizer = Tokenizer(model)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on, not the imports' (Linux)
    before, rss_before, wall = resource.getrusage(resource.RUSAGE_SELF), rss_bytes(), time.perf_counter()
    if path == "old":
        data = old.ParallelText(*old.read_parallel(src, tgt), tokenizer, 256, training=True)
    else:
        data = wmt.ParallelText(wmt.prepare_split(src, tgt, tokenizer, "train", str(prepared)), 256, training=True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert len(data) > 0 and len(data[0][1]) > 1
    return {"path": path, "pairs": len(data), "wall_s": time.perf_counter() - wall,
            "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "peak_rss_gb": after.ru_maxrss * 1024 / 1e9, "kept_rss_gb": (rss_bytes() - rss_before) / 1e9,
            "rss_before_gb": rss_before / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--words", type=int, default=26)
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "wmt-bench"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--run", nargs=4, metavar=("PATH", "SRC", "TGT", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--prepared", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # a child: one path, one line of JSON
        path, src, tgt, model = args.run
        print(json.dumps(measure(path, Path(src), Path(tgt), Path(model), Path(args.prepared))))
        return

    from datamodules.tokenizer import joint_tokenizer

    folder = Path(args.folder) / f"{args.pairs}x{args.words}"
    src, tgt = write_corpus(folder, args.pairs, args.words)
    model = joint_tokenizer([src, tgt], args.vocab_size, name="spm.en-de").model_file
    print(f"{args.pairs} pairs, {src.stat().st_size / 1e6:.0f} + {tgt.stat().st_size / 1e6:.0f} MB, "
          f"vocabulary {args.vocab_size}, {len(os.sched_getaffinity(0))} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as prepared:
        for path, label in (("old", "old (per line, 0c8872d)"), ("new", "prepared, first start"),
                            ("new", "prepared, later start")):
            out = subprocess.run([sys.executable, __file__, "--run", path, str(src), str(tgt),
                                  str(model), "--prepared", prepared], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{label:26s} cpu {r['cpu_s']:7.1f} s  wall {r['wall_s']:7.1f} s  peak RSS {r['peak_rss_gb']:5.2f} GB"
                  f"  kept {r['kept_rss_gb']:5.2f} GB (process before: {r['rss_before_gb']:.2f} GB)", flush=True)


if __name__ == "__main__":
    main()
