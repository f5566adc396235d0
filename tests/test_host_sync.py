"""No host-device synchronisation inside a training step, on each real task.

On a GPU the host queues kernels ahead of the device; an op whose result the host must read
(``.item()``, ``bool(t)``, ``.tolist()``), whose output size depends on the data (``nonzero``,
boolean-mask indexing, ``unique``, ``masked_select``) or that copies Python values onto the device
(``torch.tensor(x, device=...)``, ``t.new_tensor(...)``) makes the host wait for the queue to drain,
and the device then idles while the host queues the rest of the step. A CPU run cannot see the
waits, but it dispatches the same ops: :class:`HostSyncCounter` counts them per training step of a
real fit (the task's recipe, its demo data, Lightning's loop), split into the task's
``training_step`` (forward, loss, the non-finite-loss guard) and the rest of the optimizer step
(backward, gradient clipping, the optimizer's update), and each task must count zero in steady
steps. Device moves such as ``.cpu()`` are invisible on a CPU; on a GPU the same test also turns
on CUDA's sync debug mode, which reports every synchronizing call.
"""
from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from layers.compat import torch_dispatch_mode
from tests.conftest import run_task

aten = torch.ops.aten

#: ops that make the host wait for the device on CUDA, whatever their arguments
ALWAYS_SYNC = {
    aten._local_scalar_dense.default: "item/bool/int/tolist",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.equal.default: "equal",
    aten.bincount.default: "bincount (output size from the data)",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.lift_fresh.default: "tensor from Python values (a blocking host-to-device copy)",
}
#: indexing ops that sync when an index is a boolean mask
MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def sync_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` makes the host wait for a CUDA device, or None."""
    if func in ALWAYS_SYNC:
        return ALWAYS_SYNC[func]
    if func in MASK_INDEXING and any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
        return "boolean-mask indexing"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    return None


class SyncLog(torch_dispatch_mode()):
    """Records every op that would make the host wait for the device, with the phase it ran in."""

    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.found: list[tuple[str, str, str]] = []  # (phase, op, reason)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.found.append((self.phase, str(func), reason))
        return func(*args, **kwargs)


class HostSyncCounter(Callback):
    """Counts the syncing ops of every optimizer step (LightningModule.optimizer_step: the closure's
    training_step and backward, clipping, the update) and writes them to ``report`` (JSON: one entry
    per global step, ``{"training_step": {op: count}, "backward_and_update": {op: count}, "cuda":
    {where: count}}``, the last from CUDA's sync debug mode when the task trains on a GPU)."""

    def __init__(self, report: str):
        self.report = Path(report)
        self.steps: list[dict] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        step_fn, training_step_fn = pl_module.optimizer_step, pl_module.training_step
        log = None

        def training_step(*args, **kwargs):
            log.phase = "training_step"
            try:
                return training_step_fn(*args, **kwargs)
            finally:
                log.phase = "backward_and_update"

        def optimizer_step(*args, **kwargs):
            nonlocal log
            log = SyncLog()
            on_gpu = pl_module.device.type == "cuda"
            with log, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if on_gpu:  # on a GPU, CUDA itself reports each synchronizing call
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = step_fn(*args, **kwargs)
                finally:
                    if on_gpu:
                        torch.cuda.set_sync_debug_mode("default")
            counts = {"training_step": Counter(), "backward_and_update": Counter(), "cuda": Counter()}
            for phase, op, reason in log.found:
                counts[phase][f"{op} ({reason})"] += 1
            for warning in caught:
                if "synchroniz" in str(warning.message):
                    counts["cuda"][f"{warning.filename}:{warning.lineno}"] += 1
            self.steps.append({k: dict(v) for k, v in counts.items()})
            return result

        pl_module.training_step = training_step
        pl_module.optimizer_step = optimizer_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.report.write_text(json.dumps(self.steps, indent=1))


def test_the_counter_sees_each_kind_of_sync():
    x, mask, index = torch.randn(6), torch.tensor([True, False] * 3), torch.tensor([0, 2])
    with SyncLog() as log:
        x.sum().item(), bool(x.any()), x[mask], x.masked_select(mask), mask.nonzero(), x.new_tensor([1.0])
        x.clone()[mask] = 0.0  # two: the value becomes a tensor on the device, then the mask indexes
        torch.repeat_interleave(index), x.unique(), torch.bincount(mask.long()), torch.tensor(1.0)
        x.masked_fill(mask, 0.0), x[index], torch.where(mask, x, 0.0).sum()  # none of these
    reasons = [reason for _, _, reason in log.found]
    assert Counter(reasons) == {"item/bool/int/tolist": 2, "boolean-mask indexing": 2, "masked_select": 1,
                                "nonzero": 1, "tensor from Python values (a blocking host-to-device copy)": 3,
                                "repeat_interleave without output_size": 1, "unique": 1,
                                "bincount (output size from the data)": 1}, reasons


# the demo recipes at CPU sizes (tests/test_contract.py's), four optimizer steps
STEPS = 4
TINY = {
    "classify": ["--data.image_size", "32", "--data.eval_resize", "32", "--data.batch_size", "16",
                 "--data.num_workers", "0", "--model.scheduler.init_args.warmup_steps", "2"],
    "detect": ["--data.image_size", "64", "--data.batch_size", "4", "--data.num_workers", "0"],
    "segment": ["--data.crop_size", "64", "--data.scale_range", "[0.75, 1.25]", "--data.batch_size", "4",
                "--data.num_workers", "0"],
    "translate": ["--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
                  "--data.vocab_size", "500", "--data.max_tokens", "512"],
}
QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
         "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0"]


def steady_step_syncs(task: str, tmp_path: Path, *extra: str) -> list[dict]:
    """The syncing ops of each optimizer step after the first (which builds optimizer state and caches)."""
    report = tmp_path / "syncs.json"
    run_task(task, "fit", *TINY[task], *QUIET, "--trainer.max_steps", str(STEPS), *extra,
             "--trainer.callbacks+=tests.test_host_sync.HostSyncCounter", "--trainer.callbacks.init_args.report",
             str(report), cwd=tmp_path)
    steps = json.loads(report.read_text())
    assert len(steps) == STEPS
    return steps[1:]


@pytest.mark.parametrize("task", ["classify", "detect", "segment", "translate"])
def test_training_step_has_no_host_sync(task, tmp_path):
    steps = steady_step_syncs(task, tmp_path)
    assert all(not step["training_step"] for step in steps), steps
    assert all(not step["backward_and_update"] for step in steps), steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("task", ["classify", "detect", "segment", "translate"])
def test_training_step_has_no_host_sync_on_a_gpu(task, tmp_path):
    """The same steps on a GPU under bf16, where CUDA's sync debug mode reports every synchronizing call."""
    steps = steady_step_syncs(task, tmp_path, "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                              "--trainer.precision", "bf16-mixed")
    assert all(not step["training_step"] and not step["backward_and_update"] and not step["cuda"]
               for step in steps), steps


# -- a whole training batch, with a paper recipe's callbacks ------------------------------------------------------
def caller() -> str:
    """The innermost three frames outside torch and this file (file:line), innermost first: where a syncing op
    was asked for."""
    import traceback

    frames = [f"{Path(frame.filename).name}:{frame.lineno}" for frame in reversed(traceback.extract_stack()[:-1])
              if not any(part in frame.filename for part in ("/torch/", "/fabric/utilities/", "test_host_sync.py"))]
    return " < ".join(frames[:3]) or "?"


class WhereSyncLog(SyncLog):
    """A :class:`SyncLog` that names the line each syncing op came from instead of the phase."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None and not on_the_host():
            self.found.append((caller(), str(func), reason))
        return func(*args, **kwargs)


def on_the_host() -> bool:
    """Whether the op runs inside a LightningModule's ``on_before_batch_transfer``: the next batch, fetched while
    this one's window is open, is still on the host there on a GPU too (a read costs no device sync)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "on_before_batch_transfer":
            return True
        frame = frame.f_back
    return False


class BatchSyncCounter(Callback):
    """Counts the syncing ops of each whole training batch: from the first ``on_train_batch_start`` hook (the
    counter moves itself to the front of the callbacks) to the next batch's, or the epoch's end: every
    callback's and the module's batch hooks (progress bar, LR monitor, EMA, the guard), the optimizer step, the
    scheduler and the logger connector's update. The data arrives from a loader worker, outside the count.
    Writes ``report`` (JSON: one ``{"caller: op (reason)": count}`` per batch)."""

    def __init__(self, report: str):
        self.report = Path(report)
        self.batches: list[dict] = []
        self.window: WhereSyncLog | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.callbacks.remove(self)  # first from now on; the hook loop's next index is unchanged
        trainer.callbacks.insert(0, self)

    def close(self) -> None:
        if self.window is not None:
            self.window.__exit__(None, None, None)
            self.batches.append(dict(Counter(f"{where}: {op} ({reason})" for where, op, reason in self.window.found)))
            self.window = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.close()
        self.window = WhereSyncLog()
        self.window.__enter__()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.close()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.close()

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()
        self.report.write_text(json.dumps(self.batches, indent=1))


#: each paper task's recipe whose callbacks, logging interval and clipping the whole-batch count uses
PAPER_RECIPES = {"classify": "imagenet_mobilevitv2_200.yaml", "detect": "coco_ssdlite_mobilevitv2_100.yaml",
                 "segment": "ade20k_deeplabv3_mobilevitv2_100.yaml", "translate": "wmt14_en_de_transformer_base.yaml"}
BATCHES = 5


def paper_recipe_batch_syncs(task: str, tmp_path: Path) -> list[dict]:
    """The syncing ops of each whole batch between the first and the last of a fit of the task's demo data at CPU
    sizes with the paper recipe's trainer callbacks, ``log_every_n_steps`` and ``gradient_clip_val``, its progress
    bar and the suite's default logger on. (The first batch builds optimizer state; the last one's end logs, as
    every ``log_every_n_steps``-th does: one read of each logged value per logging interval.)"""
    import yaml

    from tests.recipes import resolve

    paper = resolve(task, PAPER_RECIPES[task])["trainer"]
    overlay = tmp_path / "paper_callbacks.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {
        "callbacks": [*paper["callbacks"], {"class_path": "tests.test_host_sync.BatchSyncCounter",
                                            "init_args": {"report": str(tmp_path / "syncs.json")}}],
        "log_every_n_steps": paper["log_every_n_steps"], "gradient_clip_val": paper.get("gradient_clip_val")}}))
    tiny = TINY[task]
    if "--data.num_workers" in tiny:  # one worker: the batches are made outside the count
        at = tiny.index("--data.num_workers")
        tiny = tiny[:at] + tiny[at + 2:]
    run_task(task, "fit", "--config", str(overlay), *tiny, "--data.num_workers", "1", "--trainer.accelerator", "cpu",
             "--trainer.num_sanity_val_steps", "0", "--trainer.limit_val_batches", "0",
             "--trainer.max_steps", str(BATCHES), cwd=tmp_path)
    batches = json.loads((tmp_path / "syncs.json").read_text())
    assert len(batches) == BATCHES
    return batches[1:-1]


def test_the_terminal_bar_reads_the_loss_at_its_interval_not_every_batch(monkeypatch):
    """Lightning's Rich bar asks for its metrics every batch; the suite's shows the training loss read from
    ``callback_metrics`` (a device value: one host read) at most once per ``loss_every_seconds``."""
    from types import SimpleNamespace

    from tasks.cli import progress

    reads = []
    monkeypatch.setattr(progress, "training_loss", lambda trainer: reads.append(1) or 0.5)
    clock = iter([100.0, 100.2, 100.9, 101.1, 101.5])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = progress.RichProgress(loss_every_seconds=1.0)
    trainer = SimpleNamespace(progress_bar_metrics={}, loggers=[], training=True)
    shown = [bar.get_metrics(trainer, None).get("loss") for _ in range(5)]
    assert shown == ["0.5000"] * 5 and len(reads) == 2  # at 100.0 and 101.1


@pytest.mark.slow
@pytest.mark.parametrize("task", list(PAPER_RECIPES))
def test_a_whole_batch_with_the_paper_callbacks_has_no_host_sync(task, tmp_path):
    """Each paper recipe's callbacks (progress bar, LR monitor, EMA), the default logger and the guard: no syncing
    op in a steady batch (Lightning's own EMA made 2 a batch, tests/test_ema.py)."""
    batches = paper_recipe_batch_syncs(task, tmp_path)
    assert all(not batch for batch in batches), batches


# -- the non-finite-loss guard decides on the device ----------------------------------------------------------
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad"])
def test_fused_optimizers_skip_an_update_on_the_device(name):
    """The guard relies on torch's fused optimizers honouring ``found_inf`` (the flag a gradient scaler
    sets): a flagged step leaves parameters, state and step count as they were, and the next step
    equals the step of an optimizer that never saw the flagged one."""
    from layers.compat import skip_update_on_device, supports_device_skip

    kwargs = {"SGD": dict(lr=0.1, momentum=0.9)}.get(name, dict(lr=0.1))
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64))
    reference = torch.nn.Parameter(param.detach().clone())
    optimizer = getattr(torch.optim, name)([param], fused=True, **kwargs)
    expected = getattr(torch.optim, name)([reference], fused=True, **kwargs)
    assert supports_device_skip(optimizer)
    for step, skip in enumerate([False, True, False]):
        grad = torch.randn(64)
        param.grad = torch.full_like(grad, float("nan")) if skip else grad
        reference.grad = grad
        skip_update_on_device(optimizer, torch.tensor(skip))
        optimizer.step()
        skip_update_on_device(optimizer, None)
        if not skip:
            expected.step()
        assert torch.equal(param, reference), (name, step)
        for key, value in expected.state[reference].items():
            assert torch.equal(optimizer.state[param][key], value), (name, step, key)
    assert not hasattr(optimizer, "found_inf")


class PoisonStep(Callback):
    """Makes the loss NaN at global step ``step`` only, and keeps a copy of the parameters and the
    optimizer state after every step. ``target="output"`` poisons the network's output (the
    gradients turn NaN too); ``"loss"`` adds NaN to the loss alone (the gradients stay finite, as
    with a NaN from the targets), so only the guard can stop the update."""

    def __init__(self, step: int, target: str = "output"):
        self.step, self.target = step, target
        self.states: list[tuple[dict, dict]] = []
        self._hook = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.target == "output":
            self._hook = pl_module.register_forward_hook(lambda module, args, output: output * float("nan"))
        else:
            loss_of = type(pl_module).training_loss
            pl_module.training_loss = lambda *args: loss_of(pl_module, *args) + torch.full((), float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        vars(pl_module).pop("training_loss", None)
        params = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
        optimizer_state = trainer.optimizers[0].state_dict()["state"]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer_state.items()}
        self.states.append((params, state))


OPTIMIZERS = {
    "fused AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "fused SGD": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
}


def fit_with_a_nonfinite_step(optimizer: str, precision: str, mode: str, recorder: PoisonStep):
    """Five steps of the classification task (MobileViTv2-0.25, 32 px, batches of the documented shape)
    whose loss is NaN at ``recorder.step``; returns the task."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    torch.manual_seed(0)
    items = [(torch.randn(3, 32, 32), i % 3) for i in range(48)]
    loader = DataLoader(items, batch_size=8, collate_fn=lambda b: {
        "image": torch.stack([x for x, _ in b]), "target": torch.tensor([y for _, y in b])})
    task = ClassificationTask(MobileViTv2(width=0.25), class_names=["a", "b", "c"], optimizer=OPTIMIZERS[optimizer],
                              on_nonfinite_loss=mode)
    # a scale small enough that no step overflows: the poisoned step is the only one to skip
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if precision == "16-mixed" else []
    trainer = Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=plugins, gradient_clip_val=1.0,
                      callbacks=[recorder])
    trainer.fit(task, loader)
    return task


def same_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (params_a, state_a), (params_b, state_b) = a, b
    return (all(torch.equal(params_a[k], params_b[k]) for k in params_a) and state_a.keys() == state_b.keys()
            and all(torch.equal(state_a[k][n], state_b[k][n]) for k in state_a for n in state_a[k]))


@pytest.mark.parametrize("target", ["output", "loss"])
@pytest.mark.parametrize("optimizer, precision", [("fused AdamW", "32-true"), ("fused AdamW", "16-mixed"),
                                                  ("fused SGD", "32-true"), ("SGD", "32-true"), ("SGD", "16-mixed")])
def test_a_skipped_step_leaves_weights_and_optimizer_state_unchanged(optimizer, precision, target):
    """Fused optimizers skip on the device (under fp16 through the scaler's check); others on the host."""
    recorder = PoisonStep(2, target)
    with pytest.warns(UserWarning, match=r"non-finite loss at global step 2 \(epoch 0, batch 2\): step skipped"):
        task = fit_with_a_nonfinite_step(optimizer, precision, "skip", recorder)
    states = recorder.states
    assert task.skipped_nonfinite_steps == 1 and len(states) == 5
    assert same_state(states[1], states[2])  # the poisoned step changed nothing
    assert not same_state(states[2], states[3])  # and training went on
    assert all(torch.isfinite(p).all() for p in states[-1][0].values())


@pytest.mark.parametrize("optimizer, steps_seen", [("fused AdamW", 3), ("SGD", 2)])
def test_a_nonfinite_loss_stops_the_run_with_no_update_applied(optimizer, steps_seen):
    """A fused step's verdict is read when the next step starts (the poisoned step ends, its update a
    no-op); a plain optimizer's before its update."""
    recorder = PoisonStep(2)
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at global step 2 \(epoch 0, batch 2\)"):
        fit_with_a_nonfinite_step(optimizer, "32-true", "raise", recorder)
    assert len(recorder.states) == steps_seen
    assert same_state(recorder.states[1], recorder.states[-1])


class NaNLossOnRank(Callback):
    """Adds NaN to the loss of global rank ``rank`` at global step ``step`` (the other ranks' stay finite)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            loss_of = type(pl_module).training_loss
            pl_module.training_loss = lambda *args: loss_of(pl_module, *args) + torch.full((), float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        vars(pl_module).pop("training_loss", None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_nonfinite_loss_on_one_rank_skips_or_stops_every_rank(mode, tmp_path):
    """Under DDP the verdict is all-reduced on the device: rank 0 (finite) reports rank 1's NaN and
    every rank skips the same update, or stops at the same step."""
    from tests.test_contract import all_finite

    proc = run_task("classify", "fit", *TINY["classify"], *QUIET, "--trainer.max_steps", "4",
                    "--trainer.devices", "2", "--trainer.strategy", "ddp", "--model.on_nonfinite_loss", mode,
                    "--checkpoint.every_n_train_steps", "1", "--trainer.callbacks+=tests.test_host_sync.NaNLossOnRank",
                    "--trainer.callbacks.init_args.step", "2", "--trainer.callbacks.init_args.rank", "1",
                    cwd=tmp_path, check=False, timeout=900)
    last = torch.load(tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt", weights_only=True)
    assert all_finite(last["state_dict"]) and all(all_finite(s) for s in last["optimizer_states"][0]["state"].values())
    if mode == "skip":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "non-finite loss at global step 2 (epoch 0, batch 2): step skipped (1 so far)" in proc.stderr
        assert last["global_step"] == 4
    else:
        assert proc.returncode != 0
        assert "non-finite loss (on another rank) at global step 2" in proc.stderr, proc.stderr[-3000:]
        assert last["global_step"] == 2
