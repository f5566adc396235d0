"""Variable-resolution batches and progressive resizing (:mod:`datamodules.resolution`).

The resolution table is checked against CVNets' rule, transcribed here from its published source
(``data/sampler/utils.py::image_batch_pairs`` today, ``_image_batch_pairs`` in v0.1), and against one table
worked by hand; the rounding against timm's ``make_divisible`` (the same TF rule); the progressive schedule
against Composer's formula. The sampler is checked for what the suite promises on top: every rank trains
the same size and batch size at every step on disjoint samples, every epoch has the same number of steps,
and a resumed loader goes on with exactly the batches the uninterrupted one would have given.
"""
import json

import numpy as np
import pytest
import torch

import tests.test_repeated_augmentation
from datamodules.resolution import (ProgressivePlan, ProgressiveResizing, ResolutionSampler, VariableBatchPlan,
                                    VariableResolution, check_schedules, make_divisible, resolution_loader,
                                    resolution_table)
from tests.conftest import run_task
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY


# -- CVNets' table -----------------------------------------------------------------------------------------------------
def cvnets_divisible(v, divisor):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def cvnets_table(crop, batch, n_gpus, max_scales, div, lo, hi, v01):
    """CVNets' image_batch_pairs for square crops, line by line as published."""
    if v01:
        dims = list(np.linspace(lo, hi, max_scales))
        if crop not in dims:
            dims.append(crop)
        scales = {(cvnets_divisible(h, div), cvnets_divisible(w, div)) for h, w in zip(dims, dims)}
        out = set()
        for h, w in scales:
            bsz = max(batch, int(round(crop * crop * batch / (h * w), 2)))
            out.add((h, w, cvnets_divisible(bsz, n_gpus)))
        return sorted(out)
    values = set(np.linspace(lo, hi, max_scales))
    values.add(crop)
    dims = sorted(cvnets_divisible(v, div) for v in values)
    return sorted({(h, w, max(1, int(round(crop * crop * batch / (h * w), 2)))) for h, w in zip(dims, dims)})


@pytest.mark.parametrize("rule", ["cvnets", "cvnets_v0.1"])
@pytest.mark.parametrize("crop,batch,gpus,scales,div,lo,hi", [
    (256, 128, 8, 5, 32, 160, 320),  # MobileViT v1 (config/classification/imagenet/mobilevit.yaml)
    (224, 256, 4, 5, 32, 128, 320),
    (256, 64, 1, 3, 16, 128, 384),
    (64, 32, 2, 4, 8, 32, 96),
    (32, 16, 3, 7, 4, 16, 64),
    (300, 10, 5, 5, 32, 100, 500),
])
def test_the_table_is_cvnets_rule(rule, crop, batch, gpus, scales, div, lo, hi):
    schedule = VariableResolution(min_size=lo, max_size=hi, scales=scales, multiple=div, rule=rule)
    assert resolution_table(crop, batch, schedule, gpus) == cvnets_table(crop, batch, gpus, scales, div, lo, hi,
                                                                         rule == "cvnets_v0.1")


def test_the_mobilevit_v1_table_worked_by_hand():
    """Base 256 px x 128 a GPU, 8 GPUs, sizes 160-320 in 5 scales rounded to 32: linspace gives 160, 200, 240, 280,
    320, which round to 160, 192, 256, 288, 320. Current rule: 256^2 x 128 / 160^2 = 327.68 -> 327; / 192^2 =
    227.6 -> 227; / 288^2 = 101.1 -> 101; / 320^2 = 81.92 -> 81. v0.1: never below 128, rounded to a multiple of
    8: 327 -> 328, 227 -> 224, the rest 128."""
    vbs = dict(min_size=160, max_size=320, scales=5, multiple=32)
    assert resolution_table(256, 128, VariableResolution(**vbs), 8) == [
        (160, 160, 327), (192, 192, 227), (256, 256, 128), (288, 288, 101), (320, 320, 81)]
    assert resolution_table(256, 128, VariableResolution(**vbs, rule="cvnets_v0.1"), 8) == [
        (160, 160, 328), (192, 192, 224), (256, 256, 128), (288, 288, 128), (320, 320, 128)]


def test_rounding_is_timms_make_divisible():
    timm_layers = pytest.importorskip("timm.layers")
    for divisor in (1, 4, 8, 32):
        for value in np.linspace(1, 700, 457).tolist() + list(range(1, 100)):
            assert make_divisible(value, divisor) == timm_layers.make_divisible(value, divisor), (value, divisor)


# -- the sampler -------------------------------------------------------------------------------------------------------
class Indices(tests.test_repeated_augmentation.Indices):
    def __init__(self, size: int = 500):
        super().__init__(size)

    def item(self, index: int, transform) -> dict:
        return {"index": index, "size": transform}


TABLE = [(16, 16, 12), (24, 24, 5), (32, 32, 3)]


def epoch_batches(world, rank, epoch, size=500, start=0, plan=None, seed=5):
    sampler = ResolutionSampler(Indices(size), plan or VariableBatchPlan(TABLE), base_batch=4, seed=seed,
                                num_replicas=world, rank=rank)
    sampler.set_epoch(epoch)
    sampler.start = start
    return list(sampler), len(sampler)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_agree_on_every_step_and_read_disjoint_samples(world):
    for epoch in range(3):
        per_rank = [epoch_batches(world, rank, epoch) for rank in range(world)]
        lengths = {length for _, length in per_rank} | {len(batches) for batches, _ in per_rank}
        assert len(lengths) == 1  # the same number of steps on every rank, and len() says it
        for step in zip(*(batches for batches, _ in per_rank)):
            assert len({(len(keys), keys[0][2]) for keys in step}) == 1  # batch size and size agree
        seen = [i for batches, _ in per_rank for keys in batches for i, _, _ in keys]
        assert len(seen) == len(set(seen))  # no sample twice (three ranks' one padding repeat falls in the tail)


def test_every_run_of_the_table_uses_each_entry_once_and_every_epoch_has_the_same_length():
    lengths = set()
    for epoch in range(6):
        batches, length = epoch_batches(1, 0, epoch)
        sizes = [(keys[0][2][0], keys[0][2][1], len(keys)) for keys in batches]
        runs = [sorted(sizes[k:k + len(TABLE)]) for k in range(0, len(sizes), len(TABLE))]
        assert all(run == TABLE for run in runs)
        lengths.add(length)
        # 500 samples, a run takes 20: 25 runs, no sample left over
        assert length == 25 * len(TABLE)
    assert len(lengths) == 1
    assert epoch_batches(1, 0, 0)[0] != epoch_batches(1, 0, 1)[0]  # each epoch its own order


def test_exact_mid_epoch_resume():
    def loader():
        return resolution_loader(Indices(), lambda size: size, VariableBatchPlan(TABLE), base_batch=4,
                                 collate_fn=list, num_workers=0, seed=5)

    whole = loader()
    whole.sampler.set_epoch(1)
    epoch = [(item["index"], item["size"]) for batch in whole for item in batch]
    first = loader()
    first.sampler.set_epoch(1)
    batches = iter(first)
    seen = [(item["index"], item["size"]) for _ in range(7) for item in next(batches)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [(item["index"], item["size"]) for batch in resumed for item in batch]
    assert state["epoch"] == 1 and state["batch_size"] == 4 and state["samples"] == len(seen)
    assert seen + rest == epoch
    # two ranks: the position counts the samples of both
    for rank in range(2):
        full, _ = epoch_batches(2, rank, 1)
        done = sum(len(keys) for keys in full[:4])
        assert epoch_batches(2, rank, 1, start=2 * done)[0] == full[4:]


def test_each_sample_is_read_at_its_batch_size_under_its_own_seed():
    """The seed of a sample is the one the fixed-size loader gives it, so the crop's random draws (its box)
    are the same at any size."""
    from datamodules.resumable import sample_seed

    batches, _ = epoch_batches(1, 0, 2)
    for keys in batches[:5]:
        assert all(seed == sample_seed(5, 2, index) for index, seed, _ in keys)


# -- progressive resizing ----------------------------------------------------------------------------------------------
def composer_size(width, elapsed, initial=0.5, finetune=0.2, delay=0.5, increment=4):
    """Composer's ProgressiveResizing.apply, on the fraction of training elapsed."""
    if elapsed >= delay:
        frac = min([(elapsed - delay) / (1 - finetune - delay), 1])
    else:
        frac = 0.0
    scale = initial + (1 - initial) * frac
    return round(width * scale / increment) * increment


@pytest.mark.parametrize("settings", [{}, dict(initial_scale=0.25, delay_fraction=0.1, finetune_fraction=0.3,
                                               multiple=16), dict(initial_scale=0.6, delay_fraction=0.0,
                                                                  finetune_fraction=0.0, multiple=8)])
def test_progressive_sizes_are_composers(settings):
    schedule = ProgressiveResizing(**settings)
    names = {"initial_scale": "initial", "delay_fraction": "delay", "finetune_fraction": "finetune",
             "multiple": "increment"}
    for fraction in np.linspace(0, 1, 101):
        for width in (224, 256, 64):
            expected = composer_size(width, fraction, **{names[k]: v for k, v in settings.items()})
            assert schedule.size_at(fraction, width) == expected


def test_progressive_plan_grows_to_the_full_size_over_training():
    plan = ProgressivePlan(ProgressiveResizing(), base_size=64, base_batch=10, max_epochs=5)
    sides = [side for epoch in range(5) for side, _, batch in plan.batches(epoch, 0, 100)]
    assert len(sides) == 50 and sides == sorted(sides)
    assert sides[0] == 32 and sides[-1] == 64
    # Composer's fraction: batch k of 50 is at k / 50 of training
    assert sides == [composer_size(64, k / 50) for k in range(50)]
    with pytest.raises(ValueError, match="trainer.max_epochs"):
        ProgressivePlan(ProgressiveResizing(), 64, 10, max_epochs=-1)


# -- refusals ----------------------------------------------------------------------------------------------------------
def test_bad_values_and_combinations_are_refused_naming_the_setting():
    for bad in (dict(min_size=0), dict(min_size=300, max_size=200), dict(scales=2.5), dict(rule="timm")):
        with pytest.raises(ValueError, match="data.variable_resolution"):
            VariableResolution(**bad)
    for bad in (dict(initial_scale=0), dict(delay_fraction=0.7, finetune_fraction=0.5), dict(multiple=0)):
        with pytest.raises(ValueError, match="data.progressive_resizing"):
            ProgressiveResizing(**bad)
    with pytest.raises(ValueError, match="choose one"):
        check_schedules(VariableResolution(), ProgressiveResizing())
    with pytest.raises(ValueError, match="repeated_augmentation"):
        check_schedules(VariableResolution(), None, repeated_augmentation=2)
    with pytest.raises(ValueError, match="streaming_root"):
        check_schedules(None, ProgressiveResizing(), streamed=True)
    with pytest.raises(ValueError, match="lower data.batch_size"):
        epoch_batches(1, 0, 0, size=15)


def test_evaluation_loaders_keep_the_fixed_size():
    from datamodules.imagefolder import ImageFolderDataModule

    datamodule = ImageFolderDataModule(image_size=32, batch_size=8, num_workers=0,
                                       variable_resolution=VariableResolution(min_size=16, max_size=48, scales=3,
                                                                              multiple=8))
    datamodule.setup("fit")
    train = datamodule.train_dataloader()
    assert isinstance(train.sampler, ResolutionSampler)
    shapes = {tuple(batch["image"].shape[1:]) for _, batch in zip(range(6), train)}
    assert shapes == {(3, 16, 16), (3, 32, 32), (3, 48, 48)}
    assert {tuple(batch["image"].shape[1:]) for _, batch in zip(range(2), datamodule.val_dataloader())} == {(3, 32, 32)}


# -- the real task -----------------------------------------------------------------------------------------------------
VBS_FLAGS = ["--data.variable_resolution.min_size", "16", "--data.variable_resolution.max_size", "48",
             "--data.variable_resolution.scales", "3", "--data.variable_resolution.multiple", "16"]


def recorded(folder, rank=0):
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


def test_classification_fit_trains_the_planned_batches(tmp_path):
    """The demo (base 32 px x 16): sizes 16, 32, 48 with batches 64, 16, 7; four steps train the plan's first four
    batches, and the checkpoint's loader position counts their samples."""
    run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *VBS_FLAGS,
             "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "1",
             "--trainer.callbacks+=tests.callbacks.RecordBatchShapes", "--trainer.callbacks.folder", "shapes",
             cwd=tmp_path)
    shapes = recorded(tmp_path / "shapes")
    sampler = ResolutionSampler(range(1257), VariableBatchPlan(
        resolution_table(32, 16, VariableResolution(16, 48, 3, 16))), base_batch=16, num_replicas=1, rank=0)
    planned = [[len(keys), 3, keys[0][2][0], keys[0][2][1]] for _, keys in zip(range(4), sampler)]
    assert [shape for _, shape in shapes] == planned
    last = torch.load(tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt", weights_only=True)
    position = last["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert position["samples"] == sum(shape[0] for shape in planned)


@pytest.mark.slow
def test_two_processes_train_the_same_size_at_every_step(tmp_path):
    """Two gloo ranks: at every step both train the same size and the same batch size (on their own samples)."""
    run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *VBS_FLAGS,
             "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_epochs", "1",
             "--trainer.limit_train_batches", "6", "--trainer.limit_val_batches", "1",
             "--trainer.callbacks+=tests.callbacks.RecordBatchShapes", "--trainer.callbacks.folder", "shapes",
             cwd=tmp_path)
    ranks = [recorded(tmp_path / "shapes", rank) for rank in (0, 1)]
    assert ranks[0] == ranks[1] and len(ranks[0]) == 6
    assert len({tuple(shape) for _, shape in ranks[0]}) > 1


@pytest.mark.slow
def test_killed_mid_epoch_resumes_exactly(tmp_path):
    """Killed after 2 of 3 steps, resumed: the same sizes, weights and optimizer state as the uninterrupted run."""
    from tests.test_contract import assert_resumed_equals_straight

    run = [*TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET, *VBS_FLAGS, "--trainer.max_epochs", "2",
           "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
           "--checkpoint.every_n_train_steps", "1", "--trainer.callbacks+=tests.callbacks.RecordBatchShapes"]
    run_task("classify", "fit", *run, "--trainer.callbacks.folder", "straight_shapes", "--trainer.default_root_dir",
             "straight", cwd=tmp_path)
    killed = run_task("classify", "fit", *run, "--trainer.callbacks.folder", "resumed_shapes",
                      "--trainer.default_root_dir", "resumed", "--trainer.callbacks+=tests.callbacks.KillAtStep",
                      "--trainer.callbacks.init_args.step", "2", cwd=tmp_path, check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    run_task("classify", "fit", *run, "--trainer.callbacks.folder", "resumed_shapes", "--trainer.default_root_dir",
             "resumed", "--ckpt_path", "last", cwd=tmp_path)
    assert_resumed_equals_straight(tmp_path, steps=6)
    # the killed run recorded step 2 before dying at its start; the resumed run trains it again
    resumed = {step: shape for step, shape in recorded(tmp_path / "resumed_shapes")}
    assert list(resumed.items()) == [tuple(record) for record in recorded(tmp_path / "straight_shapes")]


def test_a_resume_keeps_the_schedule_it_started_with():
    """A schedule is recorded in the resume settings only when set (a checkpoint from before the option resumes
    unrefused) and belongs to the data order: a resume that changes it is refused like a changed shuffle."""
    from types import SimpleNamespace

    from tasks.cli.resume import DATA_ORDER, category, resume_settings

    def settings(**data_args):
        config = SimpleNamespace(data={"class_path": "datamodules.imagefolder.ImageFolderDataModule",
                                       "init_args": data_args},
                                 trainer=SimpleNamespace(accumulate_grad_batches=1), model={})
        return resume_settings(config)

    assert "data.variable_resolution" not in settings(batch_size=8, variable_resolution=None)
    on = settings(batch_size=8, variable_resolution={"min_size": 16, "max_size": 48})
    assert on["data.variable_resolution"] == {"min_size": 16, "max_size": 48}
    assert category("data.variable_resolution") == category("data.progressive_resizing") == DATA_ORDER
