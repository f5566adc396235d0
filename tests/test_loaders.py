"""Loader conventions shared by every datamodule (datamodules/loaders.py)."""
import cv2
import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

from datamodules.loaders import make_loader


class OpenCVThreadsInWorker(Dataset):
    """Each item: the OpenCV thread count of the process that read it, after running an OpenCV kernel
    there (the kind of call albumentations makes)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        cv2.resize(np.zeros((512, 512, 3), np.uint8), (256, 256))
        return cv2.getNumThreads()


@pytest.mark.skipif(cv2.getNumThreads() < 2, reason="OpenCV runs one thread here anyway")
def test_loader_workers_run_opencv_on_one_thread_without_deadlock():
    parent_threads = cv2.getNumThreads()
    # the parent has used OpenCV's thread pool before the workers fork: the case that deadlocked
    # when the count was set inside the workers
    cv2.resize(np.zeros((2048, 2048, 3), np.uint8), (1024, 1024))
    plain = DataLoader(OpenCVThreadsInWorker(), batch_size=1, num_workers=2)
    assert {int(t) for batch in plain for t in batch} == {parent_threads}  # what the suite's loader avoids

    for train in (True, False):
        loader = make_loader(OpenCVThreadsInWorker(), batch_size=1, num_workers=2, train=train,
                             persistent_workers=False)
        assert {int(t) for batch in loader for t in batch} == {1}
    assert cv2.getNumThreads() == parent_threads  # the main process keeps its threads


def test_only_training_workers_outlive_an_epoch():
    """Evaluation workers would sit idle, holding memory, through every training epoch of a fit."""
    train = make_loader(OpenCVThreadsInWorker(), batch_size=2, num_workers=2, train=True)
    evaluation = make_loader(OpenCVThreadsInWorker(), batch_size=2, num_workers=2, train=False)
    assert train.persistent_workers and not evaluation.persistent_workers
