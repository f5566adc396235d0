"""Repeated augmentation (``data.repeated_augmentation: k``, :class:`datamodules.loaders.RepeatedAugmentationSampler`).

The order is compared with timm's ``RepeatAugSampler`` (DeiT's ``RASampler``) index for index: timm seeds
its ``torch.Generator`` with the epoch alone, the suite with ``seed + epoch`` (``DistributedSampler``'s
convention), so the suite's order at ``seed`` equals timm's at epoch ``seed + epoch`` and the two are the
same at ``seed=0``. Each copy of an image gets its own augmentation seed, the loader resumes mid-epoch
like every training loader, and ``k=1`` keeps the unrepeated sampler.
"""
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from datamodules.classification_transforms import train_transform
from datamodules.loaders import RepeatedAugmentationSampler, ResumableSampler, make_loader
from datamodules.resumable import sample_seed
from tests.conftest import run_task
from tests.test_contract import QUIET, SHAPE_OVERRIDE, TINY

timm_samplers = pytest.importorskip("timm.data.distributed_sampler")


class Indices(Dataset):
    def __init__(self, size: int = 40):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def order(size: int, repeats: int, world: int, rank: int, epoch: int, seed: int = 0, start: int = 0):
    sampler = RepeatedAugmentationSampler(Indices(size), 4, repeats, seed=seed, num_replicas=world, rank=rank)
    sampler.set_epoch(epoch)
    sampler.start = start
    return list(sampler), len(sampler)


def timm_order(size: int, repeats: int, world: int, rank: int, epoch: int):
    sampler = timm_samplers.RepeatAugSampler(Indices(size), num_replicas=world, rank=rank, num_repeats=repeats)
    sampler.set_epoch(epoch)
    return list(sampler), len(sampler)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("size", [7, 40, 255, 256, 600, 1001])
@pytest.mark.parametrize("repeats", [2, 3])
def test_the_order_is_timms_repeat_aug_sampler_index_for_index(world, size, repeats):
    for epoch in (0, 1, 5):
        for rank in range(world):
            keys, length = order(size, repeats, world, rank, epoch)
            expected, expected_length = timm_order(size, repeats, world, rank, epoch)
            assert [index for index, _ in keys] == expected and length == expected_length == len(keys)
    # another data seed: timm's order of epoch seed + epoch
    keys, _ = order(size, repeats, world, world - 1, epoch=2, seed=7)
    assert [index for index, _ in keys] == timm_order(size, repeats, world, world - 1, epoch=9)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_take_disjoint_slices_of_the_padded_repeated_permutation(world):
    size, repeats, epoch, seed = 301, 3, 4, 5
    generator = torch.Generator().manual_seed(seed + epoch)
    repeated = [i for i in torch.randperm(size, generator=generator).tolist() for _ in range(repeats)]
    per_rank = -(-size * repeats // world)
    padded = (repeated * 2)[:per_rank * world]  # wrapping round to a multiple of the world size
    ranks = [order(size, repeats, world, rank, epoch, seed)[0] for rank in range(world)]
    selected = size // 256 * 256 // world
    for rank, keys in enumerate(ranks):
        assert [index for index, _ in keys] == padded[rank::world][:selected]
    # together: the first world x selected places of the padded list, each once, and no rank draws a
    # copy (index and augmentation seed) another rank draws
    assert sorted(key for keys in ranks for key in keys) == sorted(set(key for keys in ranks for key in keys))
    interleaved = [ranks[p % world][p // world][0] for p in range(world * selected)]
    assert interleaved == padded[:world * selected]


def test_each_copy_has_its_own_seed_and_copy_0_the_unrepeated_one():
    keys, _ = order(40, 3, 1, 0, epoch=2, seed=1)
    for index in range(40):
        seeds = [seed for i, seed in keys if i == index]
        assert len(seeds) in (0, 1, 2, 3) and len(set(seeds)) == len(seeds)
    full = RepeatedAugmentationSampler(Indices(300), 4, 3, seed=1, num_replicas=1, rank=0)
    full.set_epoch(2)
    by_index: dict[int, list[int]] = {}
    for index, seed in full:
        by_index.setdefault(index, []).append(seed)
    for index, seeds in by_index.items():
        assert len(set(seeds)) == len(seeds)
        assert sample_seed(1, 2, index) in seeds or len(seeds) < 3  # copy 0 draws the unrepeated sample's seed


class RandomCrops(Dataset):
    """One random image per index through the classification training pipeline (random resized crop)."""

    def __init__(self, size: int = 12):
        self.images = torch.randint(0, 256, (size, 3, 48, 48), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0))
        self.transform = train_transform(24, (0.2, 1.0), 0.5, False, 9, 0.0, (0.5,) * 3, (0.5,) * 3, "bilinear")

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "image": self.transform(self.images[index])}


def test_two_copies_of_an_image_in_one_epoch_are_augmented_differently():
    loader = make_loader(RandomCrops(), batch_size=3, num_workers=0, train=True, seed=2, pin_memory=False,
                         repeated_augmentation=3)
    loader.sampler.set_epoch(1)
    copies: dict[int, list[torch.Tensor]] = {}
    for batch in loader:
        for index, image in zip(batch["index"].tolist(), batch["image"]):
            copies.setdefault(index, []).append(image)
    assert any(len(images) >= 2 for images in copies.values())
    for images in copies.values():
        for a in range(len(images)):
            for b in range(a + 1, len(images)):
                assert not torch.equal(images[a], images[b])


def test_exact_mid_epoch_resume():
    def loader(batch_size=5):
        made = make_loader(Indices(300), batch_size=batch_size, num_workers=0, train=True, seed=3,
                           repeated_augmentation=3)
        assert isinstance(made.sampler, RepeatedAugmentationSampler)
        return made

    def keys(sampler_epoch, start=0):
        sampler = RepeatedAugmentationSampler(Indices(300), 5, 3, seed=3, num_replicas=1, rank=0)
        sampler.set_epoch(sampler_epoch)
        sampler.start = start
        return list(sampler)

    whole = loader()
    whole.sampler.set_epoch(2)
    epoch = [int(i) for batch in whole for i in batch]
    # 300 samples round down to 256 an epoch (DeiT), 51 full batches of 5
    assert len(keys(2)) == 256 and len(whole) == 51
    assert epoch == [index for index, _ in keys(2)][:255]

    first = loader()
    first.sampler.set_epoch(2)
    batches = iter(first)
    seen = [int(i) for _ in range(7) for i in next(batches)]
    state = first.state_dict()
    assert state == {"epoch": 2, "samples": 35, "batch_size": 5}
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [int(i) for batch in resumed for i in batch]
    assert seen + rest == epoch
    # the seeds of the rest are the uninterrupted epoch's too
    assert keys(2, start=35) == keys(2)[35:]
    # two ranks: each skips its share of the samples over both
    for rank in range(2):
        full, _ = order(300, 3, 2, rank, epoch=2, seed=3)
        assert order(300, 3, 2, rank, epoch=2, seed=3, start=2 * 8)[0] == full[8:]


def test_one_copy_keeps_the_unrepeated_sampler_and_bad_values_are_refused():
    assert isinstance(make_loader(Indices(), batch_size=8, num_workers=0, train=True).sampler, ResumableSampler)
    evaluation = make_loader(Indices(), batch_size=8, num_workers=0, train=False, repeated_augmentation=3)
    assert not isinstance(evaluation.sampler, RepeatedAugmentationSampler)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="repeated_augmentation"):
            make_loader(Indices(), batch_size=8, num_workers=0, train=True, repeated_augmentation=bad)

    class Streamed(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="streaming_root"):
        make_loader(Streamed(), batch_size=8, num_workers=0, train=True, repeated_augmentation=2)


def test_every_image_datamodule_passes_the_value_through():
    from datamodules.coco import CocoDataModule
    from datamodules.imagefolder import ImageFolderDataModule
    from datamodules.segmentation import SegmentationDataModule
    from datamodules.voc_detection import VocDetectionDataModule

    for module in (ImageFolderDataModule, CocoDataModule, VocDetectionDataModule, SegmentationDataModule):
        assert module(repeated_augmentation=2).hparams.repeated_augmentation == 2
        assert module().hparams.repeated_augmentation == 1
        with pytest.raises(ValueError, match="repeated_augmentation"):
            module(repeated_augmentation=0)


@pytest.mark.slow
def test_classification_fit_with_three_repeats(tmp_path):
    """The demo's 1,257 training digits, 3 copies each: an epoch of 1,024 samples (DeiT's round to 256),
    8 steps of 128."""
    run_task("classify", "fit", *TINY["classify"], *SHAPE_OVERRIDE["classify"], *QUIET,
             "--data.batch_size", "128", "--data.repeated_augmentation", "3", "--trainer.max_epochs", "1",
             "--trainer.limit_val_batches", "1", cwd=tmp_path)
    last = torch.load(tmp_path / "runs" / "classify" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 1024 // 128
    assert last["datamodule_hyper_parameters"]["repeated_augmentation"] == 3


# -- a resume keeps the order it started with ----------------------------------------------------------------------
def _fit_settings(**data_args):
    from types import SimpleNamespace

    from tasks.cli.resume import resume_settings

    config = SimpleNamespace(data={"class_path": "datamodules.imagefolder.ImageFolderDataModule", "init_args": data_args},
                             trainer=SimpleNamespace(accumulate_grad_batches=1), model={})
    return resume_settings(config)


def test_a_resume_records_repeated_augmentation_only_when_it_is_on():
    """k = 1 is the order a checkpoint written before the option existed took, so it is not recorded (such a
    checkpoint resumes unrefused); k > 1 is, and resuming with another k is then refused as a changed order."""
    from tasks.cli.resume import CONSEQUENCE, DATA_ORDER, category

    assert "data.repeated_augmentation" not in _fit_settings(batch_size=8, repeated_augmentation=1)
    on = _fit_settings(batch_size=8, repeated_augmentation=3)
    assert on["data.repeated_augmentation"] == 3
    assert category("data.repeated_augmentation") == DATA_ORDER and DATA_ORDER in CONSEQUENCE
