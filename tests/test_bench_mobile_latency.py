"""benchmarks/bench_mobile_latency.py: runs on a tiny configuration and writes its tables; (slow) every
runtime's logits match eager PyTorch's."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_mobile_latency as bench  # noqa: E402


def test_tiny_run_writes_the_latency_table_the_pair_ratio_and_the_command(tmp_path):
    out = tmp_path / "latency.md"
    argv = ["--widths", "0.5", "--sizes", "xxs", "--runs", "2", "--size", "64", "--runtimes", "eager",
            "--out", str(out)]
    report = bench.main(argv)
    assert out.read_text() == report + "\n"
    assert "| mobilevitv2-0.5 | 1.37 |" in report and "| mobilevit-xxs | 1.27 |" in report  # params with head (M)
    assert "| eager PyTorch | " in report and "xxs / mobilevitv2-0.5 (median)" in report
    assert f"Commands: `python benchmarks/bench_mobile_latency.py {' '.join(argv)}`" in report
    assert "2 timed calls" in report and "64x64" in report


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--size", "100"])
    assert "--size must be a positive multiple of 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "m"])


def test_pairs_give_the_v1_over_v2_ratio():
    def row(label, ms):
        return {"model": label, "cells": {"eager": {"median": ms}}}

    table = bench.verdict([row("mobilevitv2-0.5", 10.0), row("mobilevit-xxs", 15.0)], ["eager"])
    assert "| eager PyTorch | 1.50 | yes |" in table
    table = bench.verdict([row("mobilevitv2-0.5", 10.0), row("mobilevit-xxs", 8.0)], ["eager"])
    assert "| eager PyTorch | 0.80 | no |" in table
    # the labels main() builds: width 1.0 is "mobilevitv2-1", and it still pairs with S
    labels = [row(f"mobilevitv2-{w:g}", 10.0) for w in (0.5, 0.75, 1.0)] + [row(f"mobilevit-{s}", 20.0)
                                                                          for s in ("xxs", "xs", "s")]
    table = bench.verdict(labels, ["eager"])
    assert "mobilevit-s / mobilevitv2-1 (median)" in table and "| eager PyTorch | 2.00 | 2.00 | 2.00 | yes |" in table


def test_merge_joins_the_rows_of_runs_made_side_by_side_without_measuring_again(tmp_path):
    def rows(label, params, ms, command):
        cell = {"median": ms, "best": ms - 1, "diff": 0.0, "build_s": 0.0}
        return [{"model": label, "params": params, "cells": {"eager": cell}, "command": command}]

    (tmp_path / "a.json").write_text(json.dumps(rows("mobilevit-xxs", 1.27, 30.0, "python run-a")))
    (tmp_path / "b.json").write_text(json.dumps(rows("mobilevitv2-0.5", 1.37, 20.0, "python run-b")))
    report = bench.main(["--widths", "0.5", "--sizes", "xxs", "--runtimes", "eager", "onnx",
                         "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    lines = report.splitlines()
    assert lines.index("| mobilevitv2-0.5 | 1.37 | 20.0 / 19.0 | not run |") < lines.index(
        "| mobilevit-xxs | 1.27 | 30.0 / 29.0 | not run |")
    assert "| eager PyTorch | 1.50 | yes |" in report and "| ONNX Runtime fp32 | not run | not run |" in report
    assert "`python run-b`; `python run-a`; `python benchmarks/bench_mobile_latency.py --widths 0.5" in report


@pytest.mark.slow  # lowering to ExecuTorch (fp32 and INT8) and ONNX: minutes here
def test_every_runtime_gives_eager_logits(tmp_path):
    pytest.importorskip("executorch")
    pytest.importorskip("onnxruntime")
    args = bench.parse_args(["--runs", "1", "--size", "64", "--calibration", "2"])
    cells = bench.measure(["mobilevitv2-0.5"], args, tmp_path)[0]["cells"]
    assert set(cells) == set(bench.RUNTIMES)
    assert cells["eager"]["diff"] == 0
    assert cells["executorch"]["diff"] < 1e-3 and cells["onnx"]["diff"] < 1e-3
    assert 0 < cells["executorch-int8"]["diff"] < 1.0  # quantized: close, not equal
