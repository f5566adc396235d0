"""Datasets optimized once into LitData chunks, then streamed from a folder or an object store.

``python -m datamodules.optimize`` (:mod:`datamodules.optimize`) writes one LitData dataset per
split, ``OUT/<split>/`` (``index.json`` + ``chunk-*.bin``), and a manifest ``OUT/streaming.json``:
the task and layout the data came from, each split's folder and sample count, and what the
model learns from the data (class names, COCO categories, the sentencepiece model). A sample
stores its encoded files as they are (JPEG/PNG bytes, never re-encoded) next to its annotations
and its ``index`` in the folder-read split.

A datamodule given ``streaming_root=OUT`` reads a split through :class:`StreamedSplit`, LitData's
``StreamingDataset``: LitData downloads, caches (``LITDATA_CACHE_DIR``, ``MAX_CACHE_SIZE``) and
reads the chunks, and shards them over DDP ranks, nodes and loader workers. An item is built from
a stored sample by the same function the folder dataset uses after reading its files, so a
streamed sample is the folder-read one, pixel for pixel.

- Training (:class:`StreamingTrainLoader`): LitData shuffles chunks and the samples inside them
  (``seed``, epoch) and gives every rank the same number of samples. Each sample's augmentation
  runs under the seed the folder loaders give it, a function of (seed, epoch, index) alone
  (:func:`datamodules.resumable.sample_seed`), whatever the order it comes in. Mid-epoch resume is
  the suite's one mechanism (:mod:`datamodules.resumable`) with LitData's own state: the loader's
  ``state_dict`` goes into Lightning's checkpoint, and LitData replays the epoch's order past the
  samples already trained on.
- Evaluation: no shuffling, no ``drop_last``: LitData deals every sample to exactly one rank, so
  metrics equal the single-process ones (README, "What every task guarantees").

Translation stores more beside a split's samples: its prepared index (:mod:`datamodules.prepared`:
token ids, lengths and raw text as flat arrays, ``OUT/<split>.tokens/``), because token batching
needs every sentence's length on every rank. :func:`write_prepared` writes it, :func:`fetch_prepared`
maps it in place from a folder or copies it once per machine from an object store.

A root that is not an optimized dataset, one written for another layout, a missing split and a
sample that cannot be read back are errors naming the folder (and the split and sample).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from litdata import StreamingDataLoader, StreamingDataset, optimize
from litdata.streaming.downloader import get_downloader
from litdata.streaming.sampler import ChunkedIndex

from datamodules.images import decode_rgb_bytes
from datamodules.resumable import SingleThreadedWorkers, run_seeded, sample_seed, world
from datamodules.prepared import PreparedIndex, prepare, prepared_home
from layers.compat import forget_restored_position

MANIFEST = "streaming.json"
#: bumped when what a sample stores changes; older optimized folders are refused, not misread
LAYOUT_VERSION = 1
REMOTE_PREFIXES = ("s3://", "gs://", "r2://", "azure://", "hf://", "local:")

# Lightning warns that an IterableDataset's length may be wrong with several workers; LitData's
# length is this rank's share, worked out for its workers
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


def is_remote(root: str) -> bool:
    """``root`` is an object-store URL LitData reads (``local:/path`` reads a folder the same way)."""
    return str(root).startswith(REMOTE_PREFIXES)


def join(root: str, name: str) -> str:
    return f"{str(root).rstrip('/')}/{name}" if is_remote(root) else str(Path(root).expanduser() / name)


def _upload(output: str, local: Path, name: str) -> None:
    """Put the file ``local`` at ``output/name`` (a folder, or an object store through LitData's uploader)."""
    if not is_remote(output):
        target = Path(output).expanduser() / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)
        return
    from litdata.streaming.fs_provider import GCPFsProvider, R2FsProvider, S3FsProvider  # LitData's own uploaders

    providers = {"s3": S3FsProvider, "gs": GCPFsProvider, "r2": R2FsProvider}
    scheme = str(output).split("://")[0]
    if scheme not in providers:
        raise ValueError(f"cannot write to {output}: LitData uploads to {', '.join(f'{p}://' for p in providers)} "
                         "(or write to a folder)")
    providers[scheme]().upload_file(str(local), join(output, name))


# -- the manifest --------------------------------------------------------------------------------------
def write_manifest(output: str, manifest: dict) -> None:
    """Write ``OUT/streaming.json`` (last, so a folder with a manifest is a finished conversion)."""
    text = json.dumps(manifest, indent=1)
    if not is_remote(output):
        path = Path(output).expanduser() / MANIFEST
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp, MANIFEST)
        local.write_text(text)
        _upload(output, local, MANIFEST)


def read_manifest(root: str, layout: str) -> dict:
    """The manifest of the optimized dataset at ``root``, checked to be of ``layout``.

    A missing folder, a folder without ``streaming.json`` (not written by ``datamodules.optimize``),
    a dataset of another layout or layout version raise errors naming ``root`` and what was expected."""
    expected = f"{join(root, MANIFEST)} written by `python -m datamodules.optimize`"
    if not is_remote(root) and not Path(root).expanduser().is_dir():
        raise FileNotFoundError(f"data.streaming_root={root} does not exist (expected an optimized dataset: "
                                f"{expected})")
    not_optimized = (f"data.streaming_root={root} is not an optimized dataset: no {expected} "
                     "(data.root reads a dataset in its standard layout)")
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(root).expanduser() / MANIFEST
        if is_remote(root):
            local = Path(tmp, MANIFEST)
            try:  # the downloader LitData reads index.json with
                get_downloader(str(root), tmp, []).download_file(join(root, MANIFEST), str(local))
            except Exception as err:  # each store reports a missing object its own way
                raise FileNotFoundError(f"{not_optimized}; reading it failed with {type(err).__name__}: {err}") from err
        try:
            manifest = json.loads(local.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(not_optimized) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{join(root, MANIFEST)} is not a streaming manifest (not JSON: {err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "visionlang-suite streaming":
        raise ValueError(f"{join(root, MANIFEST)} is not a streaming manifest of this suite")
    if manifest.get("layout") != layout:
        raise ValueError(f"data.streaming_root={root} holds {manifest.get('layout')!r} data optimized for task "
                         f"{manifest.get('task')!r}; this datamodule reads {layout!r} data (convert that dataset "
                         "with python -m datamodules.optimize and this datamodule's --task / --data)")
    if manifest.get("version") != LAYOUT_VERSION:
        raise ValueError(f"data.streaming_root={root} was optimized with layout version {manifest.get('version')}; "
                         f"this suite reads version {LAYOUT_VERSION}: convert the dataset again")
    return manifest


class OptimizedDataset:
    """The optimized dataset at ``root`` (its manifest read once, checked to be of ``layout``): what
    the data defines (:attr:`data`) and its splits as :class:`StreamedSplit`."""

    def __init__(self, root: str, layout: str):
        self.root = str(root)
        self.manifest = read_manifest(self.root, layout)

    @property
    def data(self) -> dict:
        """What the model learns from the data (class names, categories, tokenizer), as optimize wrote it."""
        return self.manifest["data"]

    def has_split(self, name: str | Sequence[str]) -> bool:
        return split_key(name) in self.manifest["splits"]

    def url(self, name: str | Sequence[str]) -> str:
        key = split_key(name)
        if not self.has_split(key):
            raise FileNotFoundError(f"data.streaming_root={self.root} has no split {key!r} (its splits: "
                                    f"{sorted(self.manifest['splits'])}); convert it with python -m "
                                    f"datamodules.optimize ... --splits {key}")
        return join(self.root, self.manifest["splits"][key]["folder"])

    def split(self, name: str | Sequence[str], make_item: Callable[[dict, str], Any] | None, train: bool = False,
              seed: int = 0) -> StreamedSplit:
        url = self.url(name)
        return StreamedSplit(url, make_item, train=train, seed=seed,
                             num_samples=self.manifest["splits"][split_key(name)]["samples"])


# -- writing ---------------------------------------------------------------------------------------------
def split_key(name: str | Sequence[str]) -> str:
    """The manifest's name of a split: a list of splits (VOC07+12) is one split named by ``+``."""
    return name if isinstance(name, str) else "+".join(name)


def split_folder(name: str | Sequence[str]) -> str:
    """The folder of a split under the optimized root (``../VOC2012/trainval`` -> ``VOC2012_trainval``)."""
    return split_key(name).replace("../", "").replace("/", "_")


def write_split(output: str, name: str, count: int, stored_sample: Callable[[int], dict], num_workers: int,
                chunk_bytes: str = "64MB") -> None:
    """Write samples ``stored_sample(0 .. count - 1)`` as the LitData dataset ``output/<folder>``, with
    LitData's progress bar. ``stored_sample`` runs in LitData's worker processes (forked where the
    platform allows: the samples' lists are shared, not pickled)."""
    folder = join(output, split_folder(name))
    try:
        optimize(fn=stored_sample, inputs=list(range(count)), output_dir=folder, chunk_bytes=chunk_bytes,
                 num_workers=max(1, num_workers), mode="overwrite", keep_data_ordered=True,
                 start_method="fork" if sys.platform == "linux" else None)
    except RuntimeError as error:
        # LitData stops its workers but not the uploaders they started: orphaned, they keep the command's
        # output open and a caller reading it waits for ever
        _end_descendants()
        # LitData wraps the worker's traceback: its first exception line is the root cause ("OSError: [Errno 28] ...")
        causes = re.findall(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$", str(error), re.MULTILINE)
        raise OSError(f"converting split {name} into {folder} failed: {causes[0].strip() if causes else error} "
                      f"(no streaming.json written; free the space or fix the cause, then run the same "
                      f"command again)") from error


def _end_descendants() -> None:
    """SIGKILL every live process descended from this one (Linux: read from /proc; elsewhere a no-op)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pending, found = [os.getpid()], []
    while pending:
        for child in parents.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def write_prepared(index: PreparedIndex, output: str, folder: str) -> dict:
    """Store a prepared index as ``output/<folder>/`` (its ``.npy`` files, then ``meta.json``) and return
    what the manifest's split entry records of it (``tokens``: folder, array names and meta)."""
    arrays = sorted(index)
    for name in arrays:
        _upload(output, index.folder / f"{name}.npy", f"{folder}/{name}.npy")
    _upload(output, index.folder / "meta.json", f"{folder}/meta.json")  # last: marks a complete copy
    return {"tokens": {"folder": folder, "arrays": arrays, "meta": index.meta}}


def fetch_prepared(root: str, stored: dict, prepared_dir: str | None = None) -> PreparedIndex:
    """The prepared index :func:`write_prepared` stored under ``root`` (``stored``: its manifest record).

    A folder's copy is mapped where it lies. An object store's is downloaded once into the local
    prepared cache (:func:`datamodules.prepared.prepare`: one process per machine downloads, the others
    wait and map it; another conversion at the same URL, with other meta, is downloaded anew)."""
    url = join(root, stored["folder"])
    if not is_remote(root):
        if not (Path(url) / "meta.json").is_file():
            raise FileNotFoundError(f"{url}/meta.json not found: data.streaming_root={root} is incomplete "
                                    "(convert it again with python -m datamodules.optimize)")
        return PreparedIndex(Path(url))
    home = prepared_home(prepared_dir)
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=home) as tmp:
        def download() -> tuple[dict, dict]:
            downloader = get_downloader(str(root), tmp, [])
            arrays = {}
            for name in stored["arrays"]:
                local = Path(tmp, f"{name}.npy")
                downloader.download_file(join(url, f"{name}.npy"), str(local))
                arrays[name] = np.load(local, mmap_mode="r")  # copied from the page cache, not held in memory
            return arrays, stored["meta"]

        # the URL as an absolute path: the cache key of an object, whatever the working directory
        key = Path("/", *url.replace("://", "/").split("/"))
        return prepare("streamed", key, {"url": url, "meta": stored["meta"]}, download, prepared_dir)


# -- reading ---------------------------------------------------------------------------------------------
def decode_rgb(data: bytes | memoryview, where: str) -> torch.Tensor:
    """(3, H, W) uint8 RGB of a streamed sample's encoded image, exactly as the folder readers decode
    the file (:func:`datamodules.images.decode_rgb_bytes`: upright by its EXIF orientation, 16-bit
    scaled). Failures raise :class:`datamodules.images.BadImageError` naming ``where``."""
    return decode_rgb_bytes(data, where)


@contextlib.contextmanager
def _quiet(logger: str):
    # LitData warns that drop_last=False under DDP could stall collectives; evaluation runs none per batch
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class StreamedSplit(StreamingDataset):
    """One split of an optimized dataset, read by LitData.

    ``make_item(sample, where)`` turns a stored sample (a dict with its encoded files, annotations and
    ``index``) into the item the folder dataset returns (or ``None`` for an unreadable image under
    ``on_bad_image="skip"``); ``where`` names the sample in errors (``<split url> sample <index>``).

    ``train``: LitData shuffles (``seed``, epoch) and drops the remainder so every rank gets as many
    samples; each item is built under :func:`datamodules.resumable.sample_seed` of its ``index``.
    Otherwise every sample is read once, in order, over all ranks together. ``num_samples``: the
    whole split's (``len`` is this rank's share).
    """

    def __init__(self, url: str, make_item: Callable[[dict, str], Any] | None, *, train: bool, seed: int = 0,
                 num_samples: int):
        with _quiet("litdata.streaming.dataset"):
            try:
                super().__init__(url, shuffle=train, drop_last=train, seed=seed)
            except (ValueError, FileNotFoundError) as err:
                raise FileNotFoundError(f"{url} is not an optimized split (no LitData index.json: {err})") from None
        self.url = url
        self.make_item = make_item
        self.train = train
        self.num_samples = num_samples
        #: the trainer's epoch being read (:class:`StreamingTrainLoader` sets it before each epoch)
        self.epoch = 0

    def set_epoch(self, current_epoch: int) -> None:
        """LitData's loader passes its own count of iterations here; the order follows the trainer's
        epoch instead (:attr:`epoch`: LitData counts from 1, so its epoch ``e + 1`` is the trainer's ``e``),
        also when a loader is built anew (``reload_dataloaders_every_n_epochs``)."""
        super().set_epoch(self.epoch + 1)

    def __getitem__(self, index: ChunkedIndex | int):
        position = index.index if isinstance(index, ChunkedIndex) else index
        try:
            sample = super().__getitem__(index)
        except Exception as err:  # a chunk that does not deserialize: name where, not LitData's internals
            raise RuntimeError(f"{self.url}: sample at position {position} cannot be read from its chunk "
                               f"({type(err).__name__}: {err})") from err
        where = f"{self.url} sample {sample['index']}" + (f" ({sample['path']})" if "path" in sample else "")
        if not self.train:
            return self.make_item(sample, where)
        seed = sample_seed(self.seed, self.epoch, int(sample["index"]))
        return run_seeded(lambda: self.make_item(sample, where), seed)


class StreamedLoader(SingleThreadedWorkers, StreamingDataLoader):
    """LitData's loader with one OpenCV thread per worker process (evaluation)."""


class StreamingTrainLoader(StreamedLoader):
    """LitData's loader for training, reading the trainer's epoch at an epoch's first fetch.

    Its ``state_dict`` is LitData's (samples handed out this epoch, per worker, and the epoch) and goes
    into Lightning's checkpoint. On a restart within an epoch Lightning hands it back through
    :meth:`load_state_dict`; the next iteration gives it to LitData, which replays the epoch's order past
    those samples (restriped by LitData itself for another batch size or world size). Lightning fetches
    no batch ahead of the one it trains from a loader with a length, so the position is that of the
    batches trained. Every other iteration starts the trainer's epoch from its beginning.
    """

    def __init__(self, dataset: StreamedSplit, *, trainer=None, **kwargs):
        super().__init__(dataset, **kwargs)
        self.trainer = trainer
        self._resume: dict | None = None
        #: the state handed back, until the iteration it was given to fetches its first batch
        self._restored: dict | None = None
        self._iterations = 0

    def load_state_dict(self, state: dict) -> None:
        self._resume = state

    def state_dict(self) -> dict:
        # LitData restores its counters (the dataset's epoch, the next worker) as the iteration starts: before
        # that its state_dict is not the state handed back. A resume after an epoch's last step, before its end
        # was checkpointed, fetches no batch, and its checkpoints would hold other counters than the run's
        return self._restored if self._restored is not None else super().state_dict()

    def __iter__(self):
        resume, self._resume = self._resume, None
        self._restored = resume
        if resume is not None:
            super().load_state_dict(resume)
        else:
            forget_restored_position(self)  # else the epoch after a resumed one would replay its position
        self._iterations += 1
        return self._epoch(self._iterations - 1, resumed=resume is not None)

    def _epoch(self, iteration: int, resumed: bool):
        # a generator: the trainer's epoch is read at the first fetch. A resume from a checkpoint written at an
        # epoch's end creates this iterator before Lightning counts the finished epoch, and an epoch read here
        # shuffled the next epoch as the finished one
        self._restored = None
        epoch = self.trainer.current_epoch if self.trainer is not None else iteration
        self.dataset.epoch = epoch
        if not resumed:
            # LitData counts epochs from 1, adding one as it starts an epoch from its beginning; a resumed state
            # holds the count. Counted from the trainer's epoch, the count in the loader's state is the
            # uninterrupted run's, also after an epoch-end resume, where Lightning hands back no state
            self.current_epoch = epoch
        yield from super().__iter__()


def streaming_loader(dataset: StreamedSplit, *, batch_size: int, num_workers: int, train: bool,
                     pin_memory: bool = True, persistent_workers: bool = True, prefetch_factor: int | None = None,
                     collate_fn: Callable | None = None, trainer=None, seed: int = 0) -> StreamingDataLoader:
    """The streamed counterpart of :func:`datamodules.loaders.make_loader` (same arguments)."""
    if train and world()[0] == 1:
        # a split smaller than one batch trains on its partial batch, as the folder loaders do (under DDP
        # LitData drops the remainder: every rank must run as many steps)
        dataset.set_drop_last(dataset.num_samples > batch_size)
    extra = {}
    if num_workers > 0:
        # training workers are started per epoch: a persistent worker keeps the copy of the dataset
        # (epoch, resume position) it was started with
        extra["persistent_workers"] = persistent_workers and not train
        if prefetch_factor is not None:
            extra["prefetch_factor"] = prefetch_factor
    loader_class = StreamingTrainLoader if train else StreamedLoader
    if train:
        extra["trainer"] = trainer
    return loader_class(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                        pin_memory=pin_memory and torch.cuda.is_available(),
                        generator=torch.Generator().manual_seed(seed), **extra)
