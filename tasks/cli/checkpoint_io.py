"""Checkpoint files written atomically, beside their destination, for every task.

Lightning's own save (``TorchCheckpointIO`` -> ``_atomic_save``) serialises into memory and
commits through an fsspec transaction, which writes a temporary file under ``$TMPDIR`` and
moves it into place. On a cluster ``$TMPDIR`` is usually another filesystem than the run, so
that move truncates ``last.ckpt`` and then copies into it: a kill during the copy leaves neither
the old nor the new checkpoint, and a small ``$TMPDIR`` fails with ``[Errno 28] No space left
on device`` naming no path.

:class:`AtomicCheckpointIO` (the suite's CLI installs it for every task) writes
``<name>.tmp-<pid>`` in the destination's own folder, fsyncs it, and ``os.replace``-s it over the
destination, then fsyncs the folder. Whatever happens before the rename, the previous file is
intact; ``$TMPDIR`` is never used. A full disk names the path, the bytes the checkpoint needs
and the bytes free there, whether it surfaces as ``ENOSPC`` or as the ``RuntimeError`` of torch's zip
writer after a short write. A remote path (``s3://``, ``gs://``, ...) is written to the same
temporary name on its own filesystem and moved there with fsspec (one upload is
all-or-nothing on object stores; the move stays within that store).
"""
from __future__ import annotations

import errno
import glob
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CheckpointDiskFull(OSError):
    """No space left for a checkpoint; the message names the path and the bytes needed."""


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint: what ``torch.save`` writes, give or take
    the pickled structure."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def temporary_name(path: str | Path) -> str:
    """``<path>.tmp-<pid>``: beside the destination, one per writing process."""
    return f"{path}.tmp-{os.getpid()}"


def _fsync_folder(folder: Path) -> None:
    # the rename is durable only once the folder's entry is on disk
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a filesystem that cannot open folders (some network mounts): nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _ByteCounter:
    """A write-only file that keeps nothing and counts what is written to it."""

    def __init__(self):
        self.written = 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        self.written += size
        return size

    def flush(self) -> None:
        pass


def serialized_bytes(checkpoint: dict) -> int:
    """What ``torch.save(checkpoint)`` writes, counted without keeping it (a failed save's size); the
    tensors' bytes when it cannot be serialized."""
    counter = _ByteCounter()
    try:
        torch.save(checkpoint, counter)
    except Exception:
        return tensor_bytes(checkpoint)
    return counter.written


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def bytes_needed_on_full_disk(err: BaseException, folder: Path, checkpoint: dict) -> int | None:
    """The bytes ``checkpoint`` needs when the failed save ``err`` ran out of space in ``folder``, else ``None``.

    A full disk shows as ``ENOSPC``, or as the error torch's zip writer raises when a write comes up
    short (``[enforce fail at inline_container.cc] unexpected pos``, a ``RuntimeError`` without an
    errno): that one counts as a full disk when less than the checkpoint's size is free in ``folder``
    now that the partial file is gone."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return serialized_bytes(checkpoint)
    if isinstance(err, RuntimeError) and "inline_container" in str(err):
        needed, free = serialized_bytes(checkpoint), free_bytes(folder)
        if free is not None and free < needed:
            return needed
    return None


def disk_full_error(path: str | Path, needed: int) -> CheckpointDiskFull:
    path = Path(path)
    free = free_bytes(path.parent)
    previous = (f"the last good checkpoint at {path} is intact" if path.is_file()
                else f"no partial file was left at {path}")
    return CheckpointDiskFull(
        errno.ENOSPC, f"no space left on device writing checkpoint {path}: it needs about {needed:,} bytes "
        f"({'free space unknown' if free is None else f'{free:,} bytes free there'}). Free space under "
        f"{path.parent}, or point --checkpoint.dirpath / --trainer.default_root_dir at a larger disk; {previous}")


def save_atomically(checkpoint: dict, path: str | Path) -> None:
    """``torch.save(checkpoint, path)`` through a temporary file beside ``path``, fsynced and
    renamed over it: readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = temporary_name(path)
    try:
        with open(partial, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException as err:  # an interrupt included: never leave a partial file behind
        Path(partial).unlink(missing_ok=True)
        needed = bytes_needed_on_full_disk(err, path.parent, checkpoint)
        if needed is not None:
            raise disk_full_error(path, needed) from err
        raise
    _fsync_folder(path.parent)
    # a writer killed mid-write (SIGKILL) left its partial file: one fit per run root and only rank 0 writes, so
    # another <path>.tmp-* is a dead process's
    for stale in path.parent.glob(f"{glob.escape(path.name)}.tmp-*"):
        stale.unlink(missing_ok=True)


def save_remote(checkpoint: dict, url: str) -> None:
    """Write ``url`` on its fsspec filesystem through ``<url>.tmp-<pid>`` moved into place there."""
    fs = get_filesystem(url)
    fs.makedirs(os.path.dirname(url), exist_ok=True)
    partial = temporary_name(url)
    try:
        with fs.open(partial, "wb") as f:
            torch.save(checkpoint, f)
        fs.mv(partial, url)
    except BaseException:
        if fs.exists(partial):
            fs.rm(partial)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic saves beside the destination (see the module)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (path {path})")
        if "://" in str(path) and not str(path).startswith("file://"):
            save_remote(checkpoint, str(path))
        else:
            save_atomically(checkpoint, str(path).removeprefix("file://"))
