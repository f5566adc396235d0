"""The paper recipes' EMA (Lightning's ``EMAWeightAveraging``, its average made a :class:`tasks.engine.ema.ForeachEMA`
by ``TaskModule.setup``): the values of torch's own EMA on the same steps, a handful of foreach kernels and no host
read per update, and a resume from a mid-run checkpoint that ends on the same average bit for bit."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

from layers.compat import weight_averaging_model
from tasks.engine.ema import ForeachEMA, ema_decay
from tests.test_host_sync import SyncLog

DECAY = 0.9


class ReferenceAverages(Callback):
    """torch's two EMAs of the same module, updated after the same optimizer steps as the callback's: Lightning's
    own (``avg_fn=get_ema_avg_fn``, one ``decay * ema + (1 - decay) * w`` per tensor) and the foreach one
    (``multi_avg_fn=get_ema_multi_avg_fn``)."""

    def setup(self, trainer, pl_module, stage):
        self.lightning = AveragedModel(pl_module, avg_fn=get_ema_avg_fn(DECAY), use_buffers=True)
        self.foreach = AveragedModel(pl_module, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lightning.update_parameters(pl_module)
        self.foreach.update_parameters(pl_module)
        self.raw = {k: v.clone() for k, v in float_state(pl_module).items()}  # before train end copies the average


def classification_fit(steps: int, callbacks: list, ckpt_path=None, root=None):
    """``steps`` optimizer steps of the classification task (MobileViTv2-0.25 with BatchNorm, 32 px, fused AdamW),
    every batch the same 8 images (a plain loader restarts a resumed epoch at its first batch)."""
    from torch.utils.data import DataLoader

    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    torch.manual_seed(0)
    items = [(torch.randn(3, 32, 32), i % 3) for i in range(8)] * 6
    loader = DataLoader(items, batch_size=8, collate_fn=lambda b: {
        "image": torch.stack([x for x, _ in b]), "target": torch.tensor([y for _, y in b])})
    task = ClassificationTask(MobileViTv2(width=0.25), class_names=["a", "b", "c"], head_dropout=0.0,
                              optimizer=lambda params: torch.optim.AdamW(params, lr=0.01, fused=True))
    trainer = Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                      default_root_dir=root)
    trainer.fit(task, loader, ckpt_path=ckpt_path)
    return task, trainer


def float_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point()}


def test_the_recipes_ema_equals_torchs_ema_on_the_same_steps():
    ema, reference = EMAWeightAveraging(decay=DECAY), ReferenceAverages()
    classification_fit(5, [ema, reference])
    average = weight_averaging_model(ema)
    assert isinstance(average, ForeachEMA) and average.decay == DECAY and average.updates == 5
    assert int(average.n_averaged) == int(reference.foreach.n_averaged) == 5  # the checkpoint's counter too
    ours, foreach, lightning = (float_state(m.module) for m in (average, reference.foreach, reference.lightning))
    assert ours.keys() == foreach.keys() == lightning.keys()
    for name in ours:
        assert torch.equal(ours[name], foreach[name]), name
        # Lightning's formula rounds differently from lerp: the same average to float32 rounding
        torch.testing.assert_close(ours[name], lightning[name], rtol=1e-6, atol=1e-7, msg=name)
    moved = [name for name in ours if not torch.equal(ours[name], reference.raw[name])]
    assert moved, "the average followed the weights exactly: the test would not see a wrong decay"
    # integer buffers stay as first copied (CVNets, timm): BatchNorm's step counter is not averaged
    counters = {k: v for k, v in average.module.state_dict().items() if k.endswith("num_batches_tracked")}
    assert counters and all(int(v) == 1 for v in counters.values())


def test_an_update_is_a_few_foreach_kernels_and_no_host_read():
    """Lightning's AveragedModel(avg_fn) reads n_averaged twice per update (two host syncs on a GPU) and runs
    three kernels per tensor; the foreach average: one lerp per dtype group and nothing the host waits for."""
    from backbones import MobileViTv2

    model = MobileViTv2(width=0.25)
    lightning = AveragedModel(model, avg_fn=get_ema_avg_fn(DECAY), use_buffers=True)
    ours = ForeachEMA(model, DECAY)
    for average in (lightning, ours):
        average.update_parameters(model)  # the first update copies
    ops: dict[str, Counter] = {}
    for name, average in (("lightning", lightning), ("ours", ours)):
        with OpLog() as log:
            average.update_parameters(model)
        ops[name] = log.ops
    syncs = {name: sum(n for op, n in counts.items() if "_local_scalar_dense" in op) for name, counts in ops.items()}
    assert syncs == {"lightning": 2, "ours": 0}, ops
    assert ops["ours"]["aten._foreach_lerp_.Scalar"] == 1, ops["ours"]
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    kernels = {name: sum(n for op, n in counts.items() if op != "aten.detach.default")  # detach: a view, no kernel
               for name, counts in ops.items()}
    assert kernels["ours"] <= 3 < tensors <= kernels["lightning"], ops


class OpLog(SyncLog):
    """Counts every aten op (tests/test_host_sync.SyncLog's mode, which also records the syncing ones)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class SaveAt(Callback):
    """Saves ``path`` after global step ``step`` (as ModelCheckpoint's every_n_train_steps does: at the batch end,
    after the EMA callbacks listed before it updated)."""

    def __init__(self, step: int, path):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_resuming_a_mid_run_checkpoint_ends_on_the_same_average(tmp_path):
    """Five steps saving at step 3 (mid-epoch), then new objects resuming that checkpoint to five steps: the same
    average and raw weights, bit for bit; the host counter is read back from the checkpoint."""
    mid = tmp_path / "mid.ckpt"
    straight_ema = EMAWeightAveraging(decay=DECAY)
    straight, _ = classification_fit(5, [straight_ema, SaveAt(3, mid)])
    assert int(torch.load(mid, weights_only=True)["averaging_state"]["n_averaged"]) == 3  # Lightning's keys
    resumed_ema = EMAWeightAveraging(decay=DECAY)
    resumed, _ = classification_fit(5, [resumed_ema], ckpt_path=mid, root=tmp_path)
    averages = [weight_averaging_model(cb) for cb in (straight_ema, resumed_ema)]
    assert averages[1].updates == 5
    for (name, a), b in zip(averages[0].state_dict().items(), averages[1].state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_decay_is_read_from_lightnings_average():
    for decay in (0.9995, 0.999, 0.9, 0.5, 0.0, 1.0):
        assert ema_decay(AveragedModel(torch.nn.Linear(2, 2), avg_fn=get_ema_avg_fn(decay))) == decay
    assert ema_decay(AveragedModel(torch.nn.Linear(2, 2))) is None  # SWA (an equal average): left as it is
    with pytest.raises(ValueError, match="the model has 4 tensors to average, its average 2"):
        ForeachEMA(torch.nn.Linear(2, 2), 0.9).averaged_pairs(torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                                                  torch.nn.Linear(2, 2)))
