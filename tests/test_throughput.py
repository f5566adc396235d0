"""The throughput readout of ``fit`` (tasks/cli/throughput.py): rates, the loader's share of the step time and
MFU against a hand computation on a fake trainer and clock; the real CLI prints the summary and logs it."""
from __future__ import annotations

import csv
from types import SimpleNamespace

import pytest
import torch

from tasks.cli import throughput as tp
from tasks.cli.throughput import Throughput, batch_size, peak_flops, training_dtype
from tests.conftest import run_task
from tests.test_contract import TINY


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Logger:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def fake_trainer(world_size=2, every=2):
    return SimpleNamespace(world_size=world_size, strategy=SimpleNamespace(root_device=torch.device("cpu")),
                           precision="32-true", is_global_zero=True, global_step=0, log_every_n_steps=every,
                           loggers=[Logger()], progress_bar_metrics={})


BATCH = {"image": torch.zeros(8, 3, 32, 32), "target": torch.zeros(8, dtype=torch.long)}


def run_steps(callback, trainer, clock, steps):
    """``steps``: (start, end, validation before it) per training step, in seconds of the fake clock."""
    module = SimpleNamespace()
    callback.on_train_start(trainer, module)
    for i, (start, end, validation) in enumerate(steps):
        if validation:
            callback.on_validation_start(trainer, module)
            callback.on_validation_end(trainer, module)
        clock.t = start
        callback.on_train_batch_start(trainer, module, BATCH, i)
        clock.t = end
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, BATCH, i)


# step 1 is the fit's first (left out); step 2 waited 0.25 s and ran 0.75 s; step 3 waited 0.5 s, ran 1 s;
# a validation precedes step 4 (left out); step 5 waited 0.25 s, ran 1.25 s
STEPS = [(0.0, 1.0, False), (1.25, 2.0, False), (2.5, 3.5, False), (10.0, 11.0, True), (11.25, 12.5, False)]


def test_rates_data_wait_and_summary_match_a_hand_computation():
    clock, trainer = Clock(), fake_trainer(world_size=2, every=2)
    callback = Throughput(clock=clock)
    run_steps(callback, trainer, clock, STEPS)
    rows = trainer.loggers[0].rows
    # reports at global steps 2 and 4, each over the counted steps since the one before, logged at the step
    # Lightning's own logging uses (global step - 1)
    assert [step for step, _ in rows] == [1, 3]
    first, second = rows[0][1], rows[1][1]
    assert first["train/throughput_per_device"] == pytest.approx(8 / 1.0)
    assert first["train/throughput"] == pytest.approx(2 * 8 / 1.0)
    assert first["train/data_wait"] == pytest.approx(0.25 / 1.0)
    assert second["train/throughput_per_device"] == pytest.approx(8 / 1.5)  # step 3 only (4 follows validation)
    assert second["train/data_wait"] == pytest.approx(0.5 / 1.5)
    assert "train/mfu" not in first  # a CPU: no peak
    # the whole fit: steps 2, 3 and 5: 24 images in 1.0 + 1.5 + 1.5 s, 1.0 s of it waiting
    assert callback.total.steps == 3
    per_device, wait = 24 / 4.0, 1.0 / 4.0
    callback.on_train_end(trainer, SimpleNamespace())
    assert (per_device, wait) == (6.0, 0.25)
    assert callback.summary == ("throughput: 12 images/s (6 per device), "
                                "the loader kept the host waiting 25 % of the step time")
    # the progress bars: the last report's rate and wait
    assert callback.progress_items() == {"img/s": "10.7", "data wait": "33 %"}
    assert trainer.progress_bar_metrics == {}  # Lightning's own bar dict is left alone
    assert callback.progress_text() == "10.7 img/s, data wait 33 %"


def test_the_callback_dispatches_no_syncing_op():
    """Its hooks and reports read shapes and the host clock only (tests/test_host_sync.py's op list)."""
    from tests.test_host_sync import SyncLog

    clock, trainer = Clock(), fake_trainer(world_size=2, every=1)
    with SyncLog() as log:
        run_steps(Throughput(clock=clock), trainer, clock, STEPS)
    assert len(trainer.loggers[0].rows) == 3 and log.found == []  # steps 2, 3, 5 (1 and 4 count nothing)


def test_mfu_from_the_model_flops_and_the_peak(monkeypatch):
    """3x the forward FLOPs per pixel of the counting input, times the batches' pixels, over the peak."""
    monkeypatch.setattr(tp, "peak_flops", lambda device, precision: 1e8)
    module = SimpleNamespace(example_input_array=torch.zeros(1, 3, 16, 16),
                             model_cost=lambda: {"params": 1, "gflops": 256e3 / 1e9})  # 1000 FLOPs per pixel
    clock, trainer = Clock(), fake_trainer(world_size=1, every=0)
    callback = Throughput(clock=clock)
    callback.on_train_start(trainer, module)
    assert callback.flops_per_unit == pytest.approx(1000)
    for i, (start, end, _) in enumerate(STEPS[:3]):
        clock.t = start
        callback.on_train_batch_start(trainer, module, BATCH, i)
        clock.t = end
        callback.on_train_batch_end(trainer, module, None, BATCH, i)
    assert trainer.loggers[0].rows == []  # log_every_n_steps 0: nothing logged
    # steps 2 and 3: 2 x 8 images of 32 x 32 px in 2.5 s
    mfu = 3 * 1000 * (2 * 8 * 32 * 32) / 2.5 / 1e8
    assert callback.metrics(callback.total)["train/mfu"] == pytest.approx(mfu)
    assert callback.summary_line().endswith(f", MFU {100 * mfu:.0f} %")
    assert callback.summary_line().startswith("throughput: 6.4 images/s, the loader kept")


def test_batch_sizes_come_from_shapes():
    assert batch_size(BATCH) == (8, 8 * 32 * 32, "images")
    translation = {"src": torch.zeros(4, 10, dtype=torch.long), "tgt_in": torch.zeros(4, 7, dtype=torch.long),
                   "tgt_out": torch.zeros(4, 7, dtype=torch.long), "src_padded": True}
    assert batch_size(translation) == (68, 68, "tokens")  # padded source + target tokens
    assert batch_size({"skipped": 3}) == (0, 0, "samples")


def test_peak_flops(monkeypatch):
    assert peak_flops(torch.device("cpu"), "bf16-mixed") is None
    assert [training_dtype(p) for p in ("bf16-mixed", "16-mixed", "32-true", None)] == ["bf16", "fp16", "fp32", "fp32"]
    cuda = torch.device("cuda", 0)
    names = {"NVIDIA H200": 989.5e12, "NVIDIA H100 80GB HBM3": 989.4e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A10": 125e12, "NVIDIA L4": 121e12, "NVIDIA GeForce RTX 4090": 165.2e12}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, "bf16-mixed") == pytest.approx(peak), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    assert peak_flops(cuda, "bf16-mixed") is None  # no bf16 on a V100
    assert peak_flops(cuda, "16-mixed") == pytest.approx(125e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-PCIE-40GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_flops(cuda, "32-true") == pytest.approx(156e12)  # TF32 tensor cores
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_flops(cuda, "32-true") == pytest.approx(19.5e12)


FIT = ["--data.num_workers", "0", "--trainer.accelerator", "cpu", "--trainer.num_sanity_val_steps", "0",
       "--trainer.limit_val_batches", "0", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2",
       "--trainer.enable_progress_bar", "false"]


@pytest.mark.slow
def test_classification_fit_prints_and_logs_the_throughput(tmp_path):
    proc = run_task("classify", "fit", *TINY["classify"], *FIT, "--trainer.logger",
                    "lightning.pytorch.loggers.CSVLogger", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "throughput: " in out and " images/s, the loader kept the host waiting " in out, out[-3000:]
    (metrics,) = (tmp_path / "runs" / "classify").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    logged = [row for row in rows if row.get("train/throughput")]
    assert [row["step"] for row in logged] == ["1", "3"]
    assert all(float(row["train/throughput"]) > 0 and 0 <= float(row["train/data_wait"]) < 1 for row in logged)


@pytest.mark.slow
def test_translation_fit_counts_tokens_and_can_be_switched_off(tmp_path):
    proc = run_task("translate", "fit", *TINY["translate"], *FIT, "--trainer.logger", "false", cwd=tmp_path)
    assert " tokens/s, the loader kept the host waiting " in proc.stdout + proc.stderr
    proc = run_task("translate", "fit", *TINY["translate"], *FIT, "--trainer.logger", "false", "--throughput", "false",
                    "--trainer.default_root_dir", "off", cwd=tmp_path)
    assert "throughput: " not in proc.stdout + proc.stderr
