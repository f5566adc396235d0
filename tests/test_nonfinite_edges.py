"""Edges of the non-finite guard (tasks/engine/nonfinite.py) on the classification task, on the CPU path of each
branch: a NaN gradient from a finite loss (no gradient scaler: fp32, bf16) is not applied, on the device for a fused
optimizer and on the host for another; a skipped update is no step of the learning-rate schedule either; the fused
skip flag is exactly 1.0 in float32 (what the kernels compare with); fp16 with the scaler and the guard in one
step; and the guard under gradient accumulation."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from tasks.engine.optim import WarmupCosineLR
from tests.test_fsdp import one_rank_group  # noqa: F401 - a fixture
from tests.test_host_sync import OPTIMIZERS, PoisonStep, same_state

WARMUP, TOTAL, BASE_LR = 2, 6, 0.01


class NaNGradientAt(PoisonStep):
    """Makes one parameter's gradient NaN at global step ``step`` while the loss stays finite (an overflow in the
    backward), recording parameters and optimizer state after every step as :class:`PoisonStep` does."""

    def __init__(self, step: int):
        super().__init__(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            param = next(p for p in pl_module.parameters() if p.requires_grad)
            self._hook = param.register_hook(lambda grad: grad * float("nan"))


class LearningRates(Callback):
    """The learning rate each optimizer step was given (read as the step begins)."""

    def __init__(self):
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


def fit(recorder: Callback, optimizer: str = "fused AdamW", precision: str = "32-true", mode: str = "skip",
        steps: int = 5, accumulate: int = 1, extra: list | None = None):
    """``steps`` optimizer steps of the classification task (MobileViTv2-0.25, 32 px) with a warm-up + cosine
    schedule and clipping at 1.0; returns the task."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    torch.manual_seed(0)
    items = [(torch.randn(3, 32, 32), i % 3) for i in range(8 * steps * accumulate)]
    loader = DataLoader(items, batch_size=8, collate_fn=lambda b: {
        "image": torch.stack([x for x, _ in b]), "target": torch.tensor([y for _, y in b])})
    task = ClassificationTask(
        MobileViTv2(width=0.25), class_names=["a", "b", "c"], optimizer=OPTIMIZERS[optimizer], on_nonfinite_loss=mode,
        scheduler=lambda opt: WarmupCosineLR(opt, warmup_steps=WARMUP, total_steps=TOTAL, warmup_init_lr=1e-4))
    plugins, precision_arg = [], precision
    if precision == "16-mixed":  # a scale small enough that no step overflows: the poisoned step is the only skip
        plugins, precision_arg = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=16.0))], None
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
                      precision=precision_arg, gradient_clip_val=1.0, accumulate_grad_batches=accumulate,
                      callbacks=[recorder, *(extra or [])])
    trainer.fit(task, loader)
    return task, trainer


@pytest.mark.parametrize("optimizer, precision", [("fused AdamW", "32-true"),  # bf16 on a CPU: ~4x the time
                                                  pytest.param("fused AdamW", "bf16-mixed", marks=pytest.mark.slow),
                                                  ("SGD", "32-true")])
def test_a_nan_gradient_from_a_finite_loss_is_not_applied(optimizer, precision):
    """Without a gradient scaler nothing else looks at the gradients: the clipping's total norm joins the verdict
    (fused: the kernel's found_inf, on the device; SGD: its gradients dropped on the host)."""
    recorder = NaNGradientAt(2)
    with pytest.warns(UserWarning, match=r"non-finite gradient at global step 2 \(epoch 0, batch 2\): step skipped"):
        task, _ = fit(recorder, optimizer, precision)
    states = recorder.states
    assert task.skipped_nonfinite_steps == 1 and len(states) == 5
    assert same_state(states[1], states[2])  # the poisoned step changed nothing
    assert not same_state(states[2], states[3])
    assert all(torch.isfinite(p).all() for p in states[-1][0].values())


def test_a_nan_gradient_from_a_finite_loss_stops_the_run_naming_it():
    with pytest.raises(FloatingPointError, match=r"non-finite gradient \(total norm nan\) from a finite loss at "
                                                 r"global step 2 \(epoch 0, batch 2\); its optimizer step made no update"):
        fit(NaNGradientAt(2), mode="raise")


@pytest.mark.parametrize("optimizer", ["fused AdamW", "SGD"])
def test_a_skipped_step_is_no_step_of_the_schedule(optimizer):
    """The schedule gives the step after a skipped one the skipped step's rate (fused: the verdict reaches the host
    as the next batch starts, before that step's update; SGD: before the skipped update itself)."""
    rates = LearningRates()
    task, trainer = fit(PoisonStep(2), optimizer, extra=[rates])
    schedule = trainer.lr_scheduler_configs[0].scheduler
    expected = [schedule.lr_at(step, BASE_LR) for step in (0, 1, 2, 2, 3)]
    assert rates.rates == pytest.approx(expected, rel=1e-12), (rates.rates, expected)
    assert schedule.last_epoch == 4  # 4 updates applied


def test_the_fused_skip_flag_is_exactly_one_in_float32():
    """torch's fused kernels skip an update only where found_inf == 1.0 (a float32 tensor)."""
    from layers.compat import skip_update_on_device

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    for skip in (torch.tensor(True), torch.tensor([True]).all(), torch.tensor(1.0) > 0):
        skip_update_on_device(optimizer, skip)
        assert optimizer.found_inf.dtype == torch.float32 and float(optimizer.found_inf) == 1.0
    skip_update_on_device(optimizer, torch.tensor(False))
    assert float(optimizer.found_inf) == 0.0


@pytest.mark.slow  # fp16 on a CPU
def test_fp16_scaler_and_a_nan_loss_in_one_step():
    """fp16: the scaler's own check sees the poisoned gradient and skips; the guard counts the step once; the loss
    scale backs off once, as for an overflow (the only skip of the run)."""
    recorder = PoisonStep(2, "loss")
    with pytest.warns(UserWarning, match=r"non-finite loss at global step 2"):
        task, trainer = fit(recorder, "fused AdamW", "16-mixed")
    assert task.skipped_nonfinite_steps == 1
    assert same_state(recorder.states[1], recorder.states[2]) and not same_state(recorder.states[2], recorder.states[3])
    assert trainer.precision_plugin.scaler.get_scale() == 8.0  # 16 halved once, never grown in 5 steps


@pytest.mark.parametrize("optimizer", ["fused AdamW", "SGD"])
def test_one_poisoned_batch_skips_the_whole_accumulated_step(optimizer):
    """Two batches per optimizer step; a NaN loss in the second batch of step 1 skips that whole step."""

    class PoisonBatch(PoisonStep):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 3:  # step 1's second batch
                loss_of = type(pl_module).training_loss
                pl_module.training_loss = lambda *args: loss_of(pl_module, *args) + torch.full((), float("nan"))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx % 2 == 1:  # after each optimizer step
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            else:
                vars(pl_module).pop("training_loss", None)

    recorder = PoisonBatch(-1)
    with pytest.warns(UserWarning, match=r"non-finite loss at global step 1 \(epoch 0, batch 3\): step skipped"):
        task, _ = fit(recorder, optimizer, steps=3, accumulate=2)
    states = recorder.states
    assert task.skipped_nonfinite_steps == 1 and len(states) == 3
    assert same_state(states[0], states[1]) and not same_state(states[1], states[2])


# -- the CUDA path of the verdict's copy, driven on the CPU with a fake event ------------------------------------
class FakeEvent:
    """A CUDA event's interface: ``record``, ``query`` (whether the copy has landed) and ``synchronize`` (wait)."""

    def __init__(self):
        self.ready, self.waited, self.recorded = False, False, False

    def record(self):
        self.recorded = True

    def query(self) -> bool:
        return self.ready

    def synchronize(self):
        self.waited = True


class Queue:
    """A guard with one verdict per global step 0..n-1, each copied through a :class:`FakeEvent`."""

    def __init__(self, n: int, nonfinite_at: int | None = None, mode: str = "raise"):
        from tasks.engine.nonfinite import LossVerdict, NonFiniteGuard

        self.guard = NonFiniteGuard(mode)
        for step in range(n):
            ok = float(step != nonfinite_at)
            values = torch.tensor([ok, ok, 0.5 if ok else float("nan")])
            self.guard.verdicts.append(LossVerdict.copy(step, 0, step, values, event=FakeEvent))
        self.events = [v.copied for v in self.guard.verdicts]


class StubModule:
    """What the guard and TaskModule.on_train_batch_start read of a module in a run of ``world_size`` ranks."""

    def __init__(self, guard, world_size: int, global_step: int):
        from types import SimpleNamespace

        self.nonfinite_guard, self.global_step = guard, global_step
        self.trainer = SimpleNamespace(world_size=world_size, lr_scheduler_configs=[])
        self.logged = []

    def log(self, *args, **kwargs):
        self.logged.append(args)


def test_the_verdict_copy_waits_only_when_read():
    """The CUDA branch of LossVerdict.copy: the host buffer and a recorded event; not ready until its event passes,
    read() waits on the event first; an unready verdict stays queued for a non-waiting resolve."""
    queue = Queue(1)
    verdict = queue.guard.verdicts[0]
    assert verdict.copied.recorded and not verdict.ready()
    assert queue.guard.resolve(StubModule(queue.guard, 1, 1), wait=False, log=False) == []
    queue.events[0].ready = True
    assert queue.guard.resolve(StubModule(queue.guard, 1, 1), wait=False, log=False) == [(0, True)]
    assert verdict.copied.waited  # read() synchronizes on the event before it reads the buffer


def test_under_ddp_a_batch_start_waits_for_verdicts_two_steps_old_only():
    """At step N each rank reads exactly the verdicts of steps <= N - 2 (waiting on their events), none younger even
    if arrived, so every rank decides at the same step; alone, only the arrived ones and no wait."""
    from tasks.engine.base import TaskModule

    queue = Queue(5)
    queue.events[4].ready = True  # arrived early on this rank: must not be read yet
    TaskModule.on_train_batch_start(StubModule(queue.guard, world_size=2, global_step=5), None, 0)
    assert [e.waited for e in queue.events] == [True, True, True, True, False]
    assert [v.step for v in queue.guard.verdicts] == [4]

    alone = Queue(3)
    alone.events[0].ready = True
    TaskModule.on_train_batch_start(StubModule(alone.guard, world_size=1, global_step=3), None, 0)
    assert not any(e.waited for e in alone.events[1:]) and [v.step for v in alone.guard.verdicts] == [1, 2]


def test_under_ddp_a_nonfinite_verdict_stops_the_run_two_steps_later_on_every_rank():
    from tasks.engine.base import TaskModule

    queue = Queue(4, nonfinite_at=2)
    TaskModule.on_train_batch_start(StubModule(queue.guard, world_size=2, global_step=3), None, 0)  # reads 0, 1
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\) at global step 2"):
        TaskModule.on_train_batch_start(StubModule(queue.guard, world_size=2, global_step=4), None, 0)


# -- fp16: a step skipped for an empty batch under DDP keeps the loss scale ----------------------------------------
class StubTask(torch.nn.Module):
    """What the guard reads of a task in a DDP run with the fp16 scaler: a network, the trainer's world size and
    precision plugin, the step."""

    def __init__(self, scaler):
        from types import SimpleNamespace

        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.trainer = SimpleNamespace(world_size=2, precision_plugin=SimpleNamespace(scaler=scaler),
                                       lr_scheduler_configs=[])
        self.global_step = self.current_epoch = 0

    def log(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("batch, scale_after", [("empty", 16.0), ("nan loss", 8.0)])
def test_an_fp16_step_skipped_for_an_empty_batch_keeps_the_loss_scale(batch, scale_after, one_rank_group):  # noqa: F811
    """The guard skips through the scaler by poisoning a gradient; the scaler then backs its scale off. Right for a
    NaN loss (an fp16 overflow), wrong for a batch with no readable image: its scale and growth count come back.
    (A gloo group of this process alone, tests/test_fsdp.py's: the guard's all-reduce runs; the stub says 2 ranks.)"""
    from tasks.engine.nonfinite import NonFiniteGuard

    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    task = StubTask(scaler)
    optimizer = torch.optim.AdamW(task.parameters(), lr=0.1, fused=True)
    before = {k: v.clone() for k, v in task.state_dict().items()}
    guard = NonFiniteGuard("skip")
    loss = task.net(torch.randn(3, 4)).sum() * (float("nan") if batch == "nan loss" else 1.0)
    loss = guard.guard(task, None if batch == "empty" else loss, 0)
    scaler.scale(loss).backward()
    guard.before_optimizer_step(task, optimizer)
    scaler.step(optimizer)
    scaler.update()
    guard.after_optimizer_step(optimizer, scaler)
    assert scaler.get_scale() == scale_after
    assert all(torch.equal(v, task.state_dict()[k]) for k, v in before.items())  # no update either way
