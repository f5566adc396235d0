"""Shared DataLoader conventions (datamodules/loaders.py)."""
import cv2
import torch
from torch.utils.data import Dataset

from datamodules.loaders import make_loader


class OpenCVThreads(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(cv2.getNumThreads())


def test_workers_run_opencv_single_threaded():
    """Albumentations runs on OpenCV, whose default pool is machine-sized; with one pool per
    worker a GPU node would oversubscribe its cores, so workers get one OpenCV thread."""
    cv2.setNumThreads(2)  # what the parent would hand down on a multi-core machine
    try:
        loader = make_loader(OpenCVThreads(), batch_size=2, num_workers=1, train=False, persistent_workers=False)
        assert torch.cat(list(loader)).tolist() == [1, 1, 1, 1]
    finally:
        cv2.setNumThreads(-1)
