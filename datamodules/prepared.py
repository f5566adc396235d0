"""Prepare once, map everywhere: a dataset's sample index built by one process, memory-mapped by all.

Listing 1.3 M ImageNet files, parsing COCO's 477 MB annotation file or tokenizing 4.5 M WMT
pairs costs minutes and gigabytes. Done on every start, in every rank, into Python objects that
every loader worker then copies (reading a refcounted object writes to its page), it dominates a
large run's start and memory. So each format writes its index once as flat numpy arrays:

    <cache>/<kind>/<source key>/<fingerprint>/{meta.json, <name>.npy ...}

and every later start, rank and worker maps those files read-only: one page-cache copy serves a
node, and forked workers share it instead of copying it.

- **One builder.** The build runs under an exclusive file lock; processes that arrive meanwhile
  wait, then map what it wrote. A build lands by renaming a finished temporary folder, so a crash
  never leaves half an index. On a filesystem shared by several nodes one rank of the cluster
  builds; a node with a local cache builds its own copy.
- **Cheap change detection.** The fingerprint is what a format can read without opening its
  samples: sizes and modification times of the annotation or text files, the modification times
  of the class folders (a folder's time changes when files are added, removed or renamed in it),
  counts, and the settings that shape the index. Another fingerprint means a rebuild, logged with
  what changed.
- **Anywhere.** The cache is ``prepared_dir`` when a datamodule is given one, else
  ``$SUITE_PREPARED_DIR``, else ``prepared/`` in the suite's data cache (``$SUITE_DATA_CACHE``);
  the dataset folder itself may be read-only. Copying a cache folder to another machine moves
  the index with it (its key is the dataset's absolute path: keep the path, or rebuild).
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from datamodules.demo import cache_home

log = logging.getLogger(__name__)

#: bump when an index layout changes, so indexes written by an older suite are rebuilt
FORMAT_VERSION = 1


def prepared_home(prepared_dir: str | os.PathLike | None = None) -> Path:
    """The folder prepared indexes live in (see the module docstring for the order of choice)."""
    if prepared_dir is not None:
        return Path(prepared_dir).expanduser()
    if os.environ.get("SUITE_PREPARED_DIR"):
        return Path(os.environ["SUITE_PREPARED_DIR"]).expanduser()
    return cache_home() / "prepared"


def file_signature(path: Path) -> dict:
    """Size and modification time of a file: what tells a replaced or edited file, without reading it."""
    stat = Path(path).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def folder_signature(folders: Iterable[Path]) -> dict:
    """Modification times of folders, keyed by name. Adding, removing or renaming a file changes
    its folder's time, so this detects a changed listing with one ``stat`` per folder."""
    return {Path(f).name: Path(f).stat().st_mtime_ns for f in folders}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


class PreparedIndex(Mapping):
    """A prepared index: its arrays (read-only memory maps) by name, and ``meta`` (a JSON dict)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self._arrays = {p.stem: np.load(p, mmap_mode="r") for p in sorted(folder.glob("*.npy"))}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


Build = Callable[[], tuple[dict[str, np.ndarray], dict]]


def prepare(kind: str, source: Path | str, fingerprint: dict, build: Build,
            prepared_dir: str | os.PathLike | None = None) -> PreparedIndex:
    """The index of ``source`` for ``fingerprint``: mapped if prepared, else ``build()`` once.

    Args:
        kind: the index format (``imagefolder``, ``coco``, ``wmt`` ...); part of the cache path.
        source: the dataset file or folder the index describes (its absolute path keys the cache).
        fingerprint: JSON-able description of the source and the settings shaping the index; an
            index built for another fingerprint is rebuilt.
        build: returns ``(arrays, meta)``: numpy arrays by name (written as ``<name>.npy``) and a
            JSON-able dict.
    """
    source = Path(source).expanduser().resolve()
    # as JSON stores it (tuples become lists), so a stored and a current fingerprint compare equal
    fingerprint = json.loads(json.dumps({"format_version": FORMAT_VERSION, **fingerprint}, default=str))
    key = f"{source.name or 'root'}-{_digest(str(source))}"
    home = prepared_home(prepared_dir) / kind / key
    folder = home / _digest(fingerprint)
    if (folder / "meta.json").is_file():
        return PreparedIndex(folder)
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"cannot create the prepared-index folder {home} for {source} ({err.strerror}): "
                      f"set --data.prepared_dir or $SUITE_PREPARED_DIR to a writable folder") from None
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here while one builds, then map its result
        if not (folder / "meta.json").is_file():
            stale = _previous_fingerprints(home, folder)
            if stale:
                log.warning("%s changed since its %s index was prepared (%s): rebuilding it in %s", source, kind,
                            _describe_change(stale[0][1], fingerprint), folder)
            else:
                log.info("preparing the %s index of %s in %s (once; later starts map it)", kind, source, folder)
            _write(folder, fingerprint, build)
            for old, _ in stale:  # processes still mapping an old index keep its open files
                shutil.rmtree(old, ignore_errors=True)
    return PreparedIndex(folder)


def _release_freed_heap() -> None:
    """Give the heap a build freed back to the system. A build parses whole annotation files (a COCO
    train JSON is ~3 GB of Python objects), and the suite asks glibc to keep freed memory for reuse
    (``tasks/cli/runtime.py``), which would otherwise keep that peak resident for the whole run."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing kept on purpose
        pass


def _write(folder: Path, fingerprint: dict, build: Build) -> None:
    arrays, meta = build()
    gc.collect()
    _release_freed_heap()
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        (tmp / "fingerprint.json").write_text(json.dumps(fingerprint, indent=1, sort_keys=True, default=str))
        # meta.json last: its presence is what marks an index complete
        (tmp / "meta.json").write_text(json.dumps(meta))
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, folder)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno == 28:
            need = sum(np.asarray(a).nbytes for a in arrays.values())
            raise OSError(28, f"no space left on the device of {folder.parent} for a prepared index of "
                              f"{need / 2**20:.0f} MiB: free space there or set --data.prepared_dir") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _previous_fingerprints(home: Path, current: Path) -> list[tuple[Path, dict]]:
    found = []
    for old in home.iterdir():
        record = old / "fingerprint.json"
        if old != current and old.is_dir() and not old.name.startswith(".") and record.is_file():
            found.append((old, json.loads(record.read_text())))
    return found


def _describe_change(old: dict, new: dict) -> str:
    changed = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            a, b = old.get(key), new.get(key)
            if isinstance(a, dict) and isinstance(b, dict):
                inner = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
                changed.append(f"{key}: {', '.join(map(str, inner[:5]))}" + (" ..." if len(inner) > 5 else ""))
            else:
                changed.append(f"{key}: {a!r} -> {b!r}")
    return "; ".join(changed) or "format"


class StringTable:
    """Strings as one UTF-8 byte buffer plus offsets, so a million file names are two arrays that
    forked workers share, not a million Python objects each worker copies on read.

    ``StringTable.encode(strings) -> (data, offsets)``; ``StringTable(data, offsets)[i] -> str``.
    """

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    @staticmethod
    def encode(strings: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
        strings = list(strings)
        joined = "".join(strings)
        data = joined.encode("utf-8")
        if len(data) == len(joined):  # ASCII, as file names mostly are: byte offsets are character offsets
            lengths = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings))
        else:
            lengths = np.fromiter((len(s.encode("utf-8")) for s in strings), dtype=np.int64, count=len(strings))
        offsets = np.zeros(len(strings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return np.frombuffer(data, dtype=np.uint8), offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> str:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.data[start:end].tobytes().decode("utf-8")
