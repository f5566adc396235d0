"""Registered weights fetched once into a cache and reused offline, as torch.hub and timm do.

:func:`fetch_weights` gives the file a registered entry (:mod:`backbones.pretrained`) is read from, first
found of:

1. the entry's ``file`` in the working directory: where the suite read weights placed by hand before it
   downloaded, so existing setups keep working;
2. the cache, ``<cache>/<entry name>/<file name of the URL>``, where ``<cache>`` is ``$SUITE_WEIGHTS_DIR``,
   else ``<torch.hub.get_dir()>/checkpoints/suite`` (torch.hub's own cache, ``$TORCH_HOME``);
3. for a timm tag, the Hugging Face hub cache that ``timm.create_model(..., pretrained=True)`` fills;
4. a download into the cache, checked against the entry's ``sha256`` where one is published.

Weights the suite's recipes make (converter ``"ours"``) are never downloaded: the message names the recipe.

A download goes to a temporary file beside its destination and is renamed into place only when it is
complete (every byte the server announced) and its hash matches, so an interrupted or corrupt download
leaves nothing a later run could read; the next run downloads again. One process per machine downloads:
the others wait on an exclusive lock on ``.<file>.lock`` beside it (``fcntl.flock``, as the prepared
dataset indexes do), then read what it wrote. Under DDP this needs no rank logic, and two unrelated runs
on a node share it too.

Environment:

- ``SUITE_WEIGHTS_DIR``: the cache folder (above).
- ``SUITE_OFFLINE=1``: never download; ``HF_HUB_OFFLINE=1`` does the same for timm's tags (the switch
  timm's own loader honours).
- ``SUITE_WEIGHTS_MIRROR=http://host[:port][/prefix]``: fetch every URL from there instead of its own
  host, keeping its path: an air-gapped cluster's mirror of the published files (pip's ``--index-url``
  plays this part for packages). ``HF_ENDPOINT`` sets the Hugging Face host for timm's tags, as it does
  for ``huggingface_hub``.

Anything unavailable raises :class:`WeightsUnavailable`, a one-line message naming the entry, the URL, the
cache path and the way out. This module reads only an entry's fields, so it imports nothing of the suite.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from backbones.pretrained import PretrainedWeights

#: what timm's loader fetches from a hub repo, in its order (timm/models/_hub.py, load_state_dict_from_hf)
HUB_FILES = ("model.safetensors", "pytorch_model.bin")
HUB_ENDPOINT = "https://huggingface.co"
#: seconds without a byte before a download is given up (the lock is then released for the next try)
TIMEOUT_S = 60.0
CHUNK = 1 << 20


class WeightsUnavailable(FileNotFoundError):
    """Registered weights that are not on this machine and cannot be downloaded; the message is one line."""


def weights_dir() -> Path:
    """The cache folder: ``$SUITE_WEIGHTS_DIR``, else ``<torch.hub.get_dir()>/checkpoints/suite``."""
    if os.environ.get("SUITE_WEIGHTS_DIR"):
        return Path(os.environ["SUITE_WEIGHTS_DIR"]).expanduser()
    import torch.hub  # only here: the module stays importable without torch for the download itself

    return Path(torch.hub.get_dir()) / "checkpoints" / "suite"


def _switched_on(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


def is_hub_entry(entry: PretrainedWeights) -> bool:
    """A timm tag: its ``url`` is a Hugging Face hub repository id (``timm/<name>``), not an address."""
    return entry.converter == "timm" and "://" not in entry.url


def offline_switch(entry: PretrainedWeights) -> str | None:
    """The variable that forbids downloading ``entry``, or ``None``."""
    variables = ("SUITE_OFFLINE", "HF_HUB_OFFLINE") if is_hub_entry(entry) else ("SUITE_OFFLINE",)
    return next((v for v in variables if _switched_on(v)), None)


def mirrored(url: str) -> str:
    """``url`` on ``$SUITE_WEIGHTS_MIRROR``'s host (and under its path), its own path kept."""
    mirror = os.environ.get("SUITE_WEIGHTS_MIRROR", "").rstrip("/")
    if not mirror:
        return url
    parts = urlsplit(url)
    return mirror + parts.path + (f"?{parts.query}" if parts.query else "")


def sources(entry: PretrainedWeights) -> list[tuple[str, str | None]]:
    """``(url, sha256)`` to try in order: the entry's URL; for a timm tag the hub's files in timm's order,
    the entry's hash being that of ``model.safetensors`` (a hash pins that file: no fallback then); none
    for the suite's own weights."""
    if entry.converter == "ours":
        return []
    if not is_hub_entry(entry):
        return [(mirrored(entry.url), entry.sha256)]
    endpoint = os.environ.get("HF_ENDPOINT", HUB_ENDPOINT).rstrip("/")
    files = HUB_FILES[:1] if entry.sha256 else HUB_FILES
    return [(mirrored(f"{endpoint}/{entry.url}/resolve/main/{name}"), entry.sha256 if i == 0 else None)
            for i, name in enumerate(files)]


def cache_path(entry: PretrainedWeights, url: str | None = None) -> Path:
    """Where ``entry`` is cached when downloaded from ``url`` (default: its first source)."""
    if url is None:
        found = sources(entry)
        url = found[0][0] if found else entry.file
    return weights_dir() / entry.name / Path(urlsplit(url).path).name


def fetch_weights(entry: PretrainedWeights) -> Path:
    """The local file of ``entry``, downloaded into the cache the first time (see the module docstring)."""
    placed = Path(entry.file).expanduser()
    if placed.is_file():
        return placed
    candidates = sources(entry)
    for url, _ in candidates:
        if cache_path(entry, url).is_file():
            return cache_path(entry, url)
    hub_file = _in_hub_cache(entry) if is_hub_entry(entry) else None
    if hub_file is not None:
        return hub_file
    if not candidates:
        raise WeightsUnavailable(
            f"weights {entry.name} are not on this machine and are made by training, not downloaded: train "
            f"{entry.url} and copy the EMA checkpoint it writes (runs/<task>/checkpoints/best-*.ckpt) to "
            f"{cache_path(entry)} or {placed}, or pass its path instead, or null to start from random weights")
    url = candidates[0][0]
    switch = offline_switch(entry)
    if switch is not None:
        raise WeightsUnavailable(
            f"weights {entry.name} are not on this machine and {switch}={os.environ[switch]} forbids downloading "
            f"{url}: download it on a machine with internet to {cache_path(entry, url)} (or unset {switch}), or pass "
            "a file path instead, or null to start from random weights")
    for url, sha256 in candidates:
        try:
            return download_once(url, cache_path(entry, url), sha256, what=f"weights {entry.name}")
        except NotPublished:
            continue  # timm's next file may be published instead
    raise WeightsUnavailable(
        f"weights {entry.name}: {url} answers 404 (not found): the entry's address is out of date; download the "
        f"file by hand to {cache_path(entry, url)}, or pass a file path instead, or null to start from random weights")


def _in_hub_cache(entry: PretrainedWeights) -> Path | None:
    """The file timm's own loader left in the Hugging Face hub cache, if any (it never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for name in HUB_FILES[:1] if entry.sha256 else HUB_FILES:
        found = try_to_load_from_cache(entry.url, name)
        if isinstance(found, str):
            return Path(found)
    return None


class NotPublished(Exception):
    """The server has no file at that address (HTTP 404): the next source may."""


def download_once(url: str, dest: Path, sha256: str | None = None, what: str = "weights") -> Path:
    """``dest``, downloaded from ``url`` unless it exists, by one process at a time (the others wait on the
    lock, then find it). Raises :class:`WeightsUnavailable` naming ``what``, ``url`` and ``dest`` when the
    download fails, stops early or has another hash; nothing is left at ``dest`` then."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WeightsUnavailable(f"{what}: cannot create the cache folder {dest.parent} ({err.strerror}): set "
                                 "SUITE_WEIGHTS_DIR to a writable folder") from None
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        _lock(lock)  # the others wait here while one downloads, then read its file
        if not dest.is_file():
            _download(url, dest, sha256, what)
    return dest


def _lock(file) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the atomic rename still keeps any reader from a partial file
        return
    fcntl.flock(file, fcntl.LOCK_EX)


def _download(url: str, dest: Path, sha256: str | None, what: str) -> None:
    def unavailable(reason: str) -> WeightsUnavailable:
        return WeightsUnavailable(
            f"{what} cannot be downloaded from {url} ({reason}); nothing was kept at {dest}: run again to retry, "
            f"or download the file by hand to that path, or set SUITE_WEIGHTS_MIRROR to a mirror of it, or pass a "
            "file path instead, or null to start from random weights")

    print(f"downloading {what} from {url} to {dest}", file=sys.stderr, flush=True)
    request = urllib.request.Request(url, headers={"User-Agent": "visionlang-suite"})
    partial = tempfile.NamedTemporaryFile(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial", delete=False)
    try:
        with partial, urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            expected = response.headers.get("Content-Length")
            digest, received = hashlib.sha256(), 0
            while chunk := response.read(CHUNK):
                partial.write(chunk)
                digest.update(chunk)
                received += len(chunk)
        if expected is not None and received != int(expected):
            raise unavailable(f"the transfer stopped after {received} of {expected} bytes")
        if sha256 is not None and digest.hexdigest() != sha256.lower():
            raise unavailable(f"its sha256 is {digest.hexdigest()}, not the published {sha256.lower()}")
        os.replace(partial.name, dest)  # atomic: a reader sees no file or the whole file
    except WeightsUnavailable:
        raise
    except urllib.error.HTTPError as err:
        if err.code == 404:
            raise NotPublished(url) from None
        raise unavailable(f"HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise unavailable(f"no connection: {err.reason}") from None
    except (OSError, http.client.HTTPException) as err:  # a reset, a timeout or a cut mid-way, a full disk
        raise unavailable(f"{type(err).__name__}: {err}") from None
    finally:
        Path(partial.name).unlink(missing_ok=True)
