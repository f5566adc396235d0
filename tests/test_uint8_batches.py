"""Classification training batches leave the loader as uint8 and are finished on the device (issue 49, item 6).

The reference is the suite's own float pipeline (``normalize_on_device=False``, itself checked against
torchvision's in tests/test_fast_transforms.py): for the same seed, every training batch finished by the
datamodule's ``on_after_batch_transfer`` equals the batch the float loader gives, with RandAugment, random
erasing and MixUp/CutMix all on, at a quarter of the bytes; and a real fit of the classification task takes
the same steps either way.
"""
from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torchvision.transforms import v2

from datamodules.classification_transforms import DeferredErasing, MixCollate, finish_on_device
from datamodules.imagefolder import ImageFolderDataModule
from tests.test_api import MEAN, STD

AUGMENTED = dict(image_size=32, eval_resize=32, rand_augment=True, random_erasing=0.5, mixup_alpha=0.8,
                 cutmix_alpha=1.0, batch_size=16, num_workers=0, mean=MEAN, std=STD)


def batches(datamodule: ImageFolderDataModule, count: int, seed: int = 0) -> list[dict]:
    """The first ``count`` training batches, seeded as a fit seeds them, through the datamodule's transfer hook."""
    torch.manual_seed(seed)
    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    return [datamodule.on_after_batch_transfer(next(loader), 0) for _ in range(count)]


def test_the_finished_uint8_batch_equals_the_float_pipelines_with_every_augmentation_on():
    on_device = batches(ImageFolderDataModule(**AUGMENTED), 6)
    in_workers = batches(ImageFolderDataModule(**AUGMENTED, normalize_on_device=False), 6)
    for got, expected in zip(on_device, in_workers):
        assert set(got) == set(expected) and got["image"].dtype == torch.float32
        torch.testing.assert_close(got["image"], expected["image"], atol=2e-6, rtol=0)
        torch.testing.assert_close(got["target"], expected["target"], atol=0, rtol=0)
        assert torch.equal(got["index"], expected["index"])


def test_the_loader_ships_a_quarter_of_the_bytes():
    torch.manual_seed(0)
    datamodule = ImageFolderDataModule(**AUGMENTED)
    datamodule.setup("fit")
    shipped = next(iter(datamodule.train_dataloader()))
    assert shipped["image"].dtype == torch.uint8 and shipped["erase"].shape == (16, 4)
    assert shipped["mix"][0] in ("mixup", "cutmix")
    finished = datamodule.on_after_batch_transfer(dict(shipped), 0)
    assert finished["image"].nbytes == 4 * shipped["image"].nbytes
    assert "erase" not in finished and "mix" not in finished  # the step sees the float pipeline's keys


def test_deferred_erasing_and_mixing_equal_torchvisions_for_each_seed():
    """Per seed: torchvision's RandomErasing after Normalize, then its MixUp or CutMix, against the recorded
    draws applied by finish_on_device to the uint8 images."""
    mean = torch.tensor(MEAN).view(-1, 1, 1)
    std = torch.tensor(STD).view(-1, 1, 1)
    images = torch.randint(0, 256, (5, 3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    reference_erase = v2.RandomErasing(p=0.7, value=0)
    reference_mix = v2.RandomChoice([v2.MixUp(alpha=0.8, num_classes=4), v2.CutMix(alpha=1.0, num_classes=4)])
    labels = torch.tensor([0, 1, 2, 3, 1])
    erased_some = mixed = cut = 0
    for seed in range(40):
        torch.manual_seed(seed)
        floats = [v2.functional.normalize(v2.functional.to_dtype(image, torch.float32, scale=True), MEAN, STD)
                  for image in images]
        expected = torch.stack([reference_erase(image) for image in floats])
        expected, expected_targets = reference_mix(expected, labels)

        torch.manual_seed(seed)
        items = [{**DeferredErasing(p=0.7)(image), "target": int(label)} for image, label in zip(images, labels)]
        collate = MixCollate(4, mixup_alpha=0.8, cutmix_alpha=1.0, on_device=True)
        batch = collate(items)
        erased_some += int(batch["erase"][:, 2].gt(0).any())
        mixed += batch["mix"][0] == "mixup"
        cut += batch["mix"][0] == "cutmix"
        got = finish_on_device(batch, mean, std)
        torch.testing.assert_close(got["image"], expected, atol=2e-6, rtol=0, msg=f"seed {seed}")
        torch.testing.assert_close(got["target"], expected_targets, atol=0, rtol=0)
    assert erased_some > 20 and mixed > 5 and cut > 5  # every branch was taken


def test_a_fit_of_the_classification_task_takes_the_same_steps_either_way(tmp_path):
    """Three optimizer steps of the real task (MobileViTv2-0.25 on the digits demo, every augmentation on):
    the same weights, whether the float steps ran in the loader or on the device."""
    from tasks.classify import ClassificationTask
    from tests.test_api import tiny_backbone

    def fit(normalize_on_device: bool) -> dict:
        torch.manual_seed(0)
        datamodule = ImageFolderDataModule(**AUGMENTED, normalize_on_device=normalize_on_device)
        model = ClassificationTask(tiny_backbone(), class_names=datamodule.classes)
        trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, accelerator="cpu", limit_val_batches=0,
                          default_root_dir=tmp_path)
        trainer.fit(model, datamodule)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    on_device, in_workers = fit(True), fit(False)
    assert on_device.keys() == in_workers.keys()
    moved = [key for key, value in on_device.items()
             if value.is_floating_point() and not torch.equal(value, tiny_backbone_state().get(key, value))]
    assert moved  # the steps changed the weights: the comparison below compares trained weights
    for key, value in on_device.items():
        torch.testing.assert_close(value, in_workers[key], atol=1e-5, rtol=1e-4, msg=key)


def tiny_backbone_state() -> dict:
    from tests.test_api import tiny_backbone

    return {f"backbone.{k}": v for k, v in tiny_backbone().state_dict().items()}


def test_finishing_on_the_device_reads_nothing_back_from_it():
    """The hook runs on the device every training step: none of its ops may make the host wait
    (tests/test_host_sync.py's list: item/tolist, data-dependent sizes, boolean-mask indexing, Python values
    copied to the device)."""
    from tests.test_host_sync import SyncLog

    torch.manual_seed(1)
    datamodule = ImageFolderDataModule(**AUGMENTED)
    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    shipped = [next(loader) for _ in range(4)]
    datamodule.on_after_batch_transfer(dict(shipped[0]), 0)  # the first batch puts mean and std on the device
    assert {batch["mix"][0] for batch in shipped[1:]} <= {"mixup", "cutmix"}
    with SyncLog() as log:
        for batch in shipped[1:]:
            datamodule.on_after_batch_transfer(batch, 0)
    assert log.found == []
