"""Reading image files, once for every vision datamodule.

One decoder path (torchvision's libjpeg-turbo / libpng, PIL for the formats torchvision does
not decode), one list of image extensions, one rule for hidden files, one error that names
the file, and one lister of the images ``predict`` reads (:func:`predict_images`). 16-bit
images are scaled to 8 bits (``round(v / 257)``) instead of being clipped to white, as PIL's
``convert("RGB")`` does. An image whose header declares more pixels than PIL's decompression-bomb
limit (:func:`pixel_limit`) is refused before it is decoded, naming the file and the limit.

Images come out upright: an EXIF orientation tag (a phone's portrait photo is stored landscape
with tag 6) is applied, for files (:func:`read_rgb`) and for stored bytes
(:func:`decode_rgb_bytes`) alike, so pixels, boxes, masks and every reported size refer to the
image as viewers show it. Only a tagged image pays for it (PIL reads its tag, OpenCV turns the
decoded pixels: about half a decode more); an untagged file costs one search of its first 64 KiB.

The listers say what they leave out: a file whose extension is not an image's (``.gif``,
``.heic``, ``.txt``), a broken link, an entry that cannot be examined. :class:`SkippedFiles`
counts them over one listing and warns once with the total and a few names; hidden files are
never data and are not counted.

Outputs named after their image (detection's JSON, segmentation's masks) use
:func:`output_names`: the stem, or the file name with its extension where two images share a
stem, so no output overwrites another.

``on_bad_image`` is the same switch in every vision datamodule: ``"fail"`` stops at the first
unreadable file with :class:`BadImageError` naming it; ``"skip"`` makes the dataset return
``None`` for it, and :func:`collate_skipping` drops such items and counts them in the batch
(``batch["skipped"]``), which the task logs as ``data/skipped_images``.
"""
from __future__ import annotations

import errno
import io
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Literal

import numpy as np
import torch
from torch.utils.data import default_collate

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")

OnBadImage = Literal["fail", "skip"]


class BadImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file and the way out."""

    def __init__(self, path: Path | str, reason: str):
        self.path = Path(path)
        super().__init__(f"cannot read image {path}: {reason} "
                         "(set data.on_bad_image=skip to skip and count such files)")


def is_hidden(path: Path) -> bool:
    """Dot-files and dot-folders (``.ipynb_checkpoints``, ``.git``, macOS ``._x.jpg``) are never data."""
    return path.name.startswith(".")


class SkippedFiles:
    """What one listing of image files left out, by reason, with the first few of each, reported once.

    Reasons (:data:`REASONS`): ``"file of another type"`` (an extension outside :data:`IMAGE_EXTENSIONS`,
    e.g. ``.gif``, ``.heic``), ``"broken link"`` (a symlink to nothing), ``"link loop"`` (symlinks that
    lead back to themselves), ``"unreadable entry"`` (it cannot be examined, or is no regular file: a
    socket, a pipe), ``"image in a sub-folder"`` (an image inside a folder within a class folder, which the
    ImageFolder layout does not read: ``train/cat/more/x.png``). Hidden files are not counted.

    A caller that lists many folders as one (a class folder each) passes one instance to every
    :func:`list_images` / :func:`image_tree` call and calls :meth:`report` once at the end; without one,
    each of those functions reports its own listing."""

    #: each reason, singular -> plural
    REASONS = {"file of another type": "files of other types", "broken link": "broken links",
               "link loop": "link loops", "unreadable entry": "unreadable entries",
               "image in a sub-folder": "images in sub-folders"}
    #: what a reason needs said about it
    NOTES = {"image in a sub-folder": "a class's images lie directly in its folder, <split>/<class>/<image>: move "
                                      "them up a level to train on them"}
    EXAMPLES = 3

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[Path]] = {}

    def add(self, reason: str, path: Path) -> None:
        self.counts[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < self.EXAMPLES:
            shown.append(path)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self, where: Path | str) -> str:
        """One sentence: how many entries of ``where`` were left out, per reason with a few names;
        ``""`` when none was."""
        if not self.total:
            return ""
        parts = []
        for reason, count in self.counts.most_common():
            names = [_relative(p, where) for p in self.examples[reason]]
            more = ", ..." if count > len(names) else ""
            parts.append(f"{count} {reason if count == 1 else self.REASONS[reason]} ({', '.join(names)}{more})")
        notes = "".join(f"; {self.NOTES[reason]}" for reason in self.counts if reason in self.NOTES)
        return (f"left out {self.total} {'entry' if self.total == 1 else 'entries'} of {where} that are not read as "
                f"images: {'; '.join(parts)} (images are {', '.join(IMAGE_EXTENSIONS)}; hidden files are ignored"
                f"{notes})")

    def report(self, where: Path | str) -> None:
        """Warn once (on rank 0) with :meth:`describe`, when anything was left out."""
        if self.total:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(self.describe(where))


def _relative(path: Path, where: Path | str) -> str:
    try:
        return path.relative_to(where).as_posix()
    except ValueError:
        return str(path)


def entry_kind(entry: os.DirEntry) -> str:
    """``"image"``, ``"folder"`` or why the directory entry ``entry`` is left out (a :class:`SkippedFiles`
    reason). Read from the listing itself: only a symlink or an odd entry costs a ``stat``."""
    try:
        if entry.is_dir():  # follows links: a link to a folder is a folder
            return "folder"
        regular = entry.is_file()
    except OSError as err:
        return "link loop" if err.errno == errno.ELOOP else "unreadable entry"
    if regular:
        return "image" if os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS else "file of another type"
    if entry.is_symlink() and not os.path.exists(entry.path):
        return "broken link"
    return "unreadable entry"  # a socket, a pipe, a device


def is_regular_file(entry: os.DirEntry) -> bool:
    """``entry.is_file()``, with ``False`` for an entry that cannot be examined (a symlink loop raises)."""
    try:
        return entry.is_file()
    except OSError:
        return False


def _listing(folder: Path, skipped: SkippedFiles) -> tuple[list[Path], list[Path]]:
    """(image files, sub-folders) directly inside ``folder``, sorted; hidden entries left out, the rest
    counted in ``skipped``."""
    images, folders = [], []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith("."):  # is_hidden: never data, not counted
                continue
            kind = entry_kind(entry)
            if kind == "image":
                images.append(Path(entry.path))
            elif kind == "folder":
                folders.append(Path(entry.path))
            else:
                skipped.add(kind, Path(entry.path))
    return sorted(images), sorted(folders)


def list_images(folder: Path, skipped: SkippedFiles | None = None) -> list[Path]:
    """Image files directly inside ``folder``, sorted, hidden files left out. Other files, broken links
    and unreadable entries are counted in ``skipped``; without it, they are reported here, once."""
    own = skipped is None
    skipped = SkippedFiles() if own else skipped
    images, _ = _listing(Path(folder), skipped)
    if own:
        skipped.report(folder)
    return images


def image_tree(folder: Path, skipped: SkippedFiles | None = None) -> list[Path]:
    """Image files in ``folder`` and its sub-folders, sorted; hidden files and folders left out, the
    rest counted as in :func:`list_images` (reported once for the whole tree)."""
    own = skipped is None
    skipped = SkippedFiles() if own else skipped
    files, folders = _listing(Path(folder), skipped)
    for sub in folders:
        files += image_tree(sub, skipped)
    if own:
        skipped.report(folder)
    return sorted(files)


def predict_images(path: Path | str, recursive: bool = False) -> list[Path]:
    """The images to predict on (``data.predict_path``): ``path`` itself if it is a file, else the
    image files in the folder ``path`` (sorted, hidden files left out), with those of its
    sub-folders if ``recursive``; what the folder holds besides images is counted and reported once
    (:class:`SkippedFiles`). A file that is not an image, a missing path, or a folder without
    images is an error naming ``data.predict_path``."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise ValueError(f"data.predict_path={path} is not an image file "
                             f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
        return [path]
    if not path.is_dir():
        if path.is_symlink():
            raise FileNotFoundError(f"data.predict_path={path} is a broken link (to {os.readlink(path)})")
        raise FileNotFoundError(f"data.predict_path={path} does not exist (give an image file or a folder of images)")
    skipped = SkippedFiles()
    images = image_tree(path, skipped) if recursive else list_images(path, skipped)
    if not images:
        where = "in it or its sub-folders" if recursive else "directly inside it (sub-folders are not searched)"
        left_out = f"; {skipped.describe(path)}" if skipped.total else ""
        raise FileNotFoundError(f"data.predict_path={path} holds no images {where} "
                                f"(extensions {', '.join(IMAGE_EXTENSIONS)}){left_out}")
    skipped.report(path)
    return images


def output_names(paths: Iterable[Path | str]) -> dict[str, str]:
    """The name each image's outputs get (``<name>.json``, ``masks/<name>.png``), keyed by ``str(path)``.

    An image's name is its stem (``photo``), unless another of ``paths`` has the same stem (compared
    case-insensitively, as macOS and Windows file systems do): then it is the path relative to the
    folder those images share, extension kept (``photo.jpg`` and ``photo.png``; ``a/photo.jpg`` and
    ``b/photo.jpg``), so no output overwrites another. Single-stem outputs keep their plain names."""
    paths = list(dict.fromkeys(str(p) for p in paths))
    names = {p: Path(p).stem for p in paths}
    while True:
        groups: dict[str, list[str]] = {}
        for p in paths:
            groups.setdefault(names[p].casefold(), []).append(p)
        clashing = [group for group in groups.values() if len(group) > 1]
        changed = False
        for group in clashing:
            common = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in group])
            for p in group:
                full = Path(os.path.relpath(os.path.abspath(p), common)).as_posix()
                changed |= names[p] != full
                names[p] = full
        if not changed:  # no clash left (or names differing only in case, which stay apart on Linux)
            return names


def _to_uint8(image: torch.Tensor) -> torch.Tensor:
    if image.dtype == torch.uint8:
        return image
    if image.dtype == torch.uint16:  # 16-bit PNG: 65535 -> 255
        return (image.to(torch.int32) * 255 + 32767).div(65535, rounding_mode="floor").to(torch.uint8)
    raise TypeError(f"unexpected decoded dtype {image.dtype}")


#: the EXIF tag saying how to turn the stored pixels upright (1: as stored; 2-8: flips and turns)
ORIENTATION = 0x0112


def _read_with_pil(source) -> torch.Tensor:
    """``source``: a path or a file object; the EXIF orientation is applied."""
    from PIL import Image

    with Image.open(source) as img:
        return pil_rgb(img)


def pil_rgb(img) -> torch.Tensor:
    """An opened PIL image -> (3, H, W) uint8 RGB, upright (its EXIF orientation applied), a 16-bit image
    (mode ``I;16``, or ``I`` with values over 255) scaled 65535 -> 255 as a 16-bit file is, not clipped."""
    from PIL import ImageOps

    if img.getexif().get(ORIENTATION, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        values = np.asarray(img, dtype=np.int64)
        peak = 65535 if img.mode.startswith("I;16") or values.max() > 255 else 255
        gray = np.clip(np.rint(values * (255.0 / peak)), 0, 255).astype(np.uint8)
        array = np.repeat(gray[..., None], 3, axis=2)
    else:
        array = np.array(img.convert("RGB"))  # a copy: PIL's buffer is read-only
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def _is_tagged_webp(head: bytes) -> bool:
    """``head`` starts a WebP file whose extended header (VP8X) flags EXIF data."""
    return head[:4] == b"RIFF" and head[8:12] == b"WEBP" and head[12:16] == b"VP8X" and len(head) > 20 \
        and bool(head[20] & 0x08)


def exif_orientation(source: Path | str | bytes | memoryview) -> int:
    """The EXIF orientation (1..8) of an image file or its encoded bytes; 1 when it has none or
    cannot be read. Sizes swap for 5..8 (a quarter turn)."""
    from PIL import Image

    try:
        opened = Image.open(io.BytesIO(bytes(source)) if isinstance(source, (bytes, memoryview)) else source)
        with opened as img:
            value = int(img.getexif().get(ORIENTATION, 1))
    except Exception:  # an unreadable file is reported by the reader, not here
        return 1
    return value if 1 <= value <= 8 else 1


def _stored_orientation(encoded: torch.Tensor) -> int:
    """The EXIF orientation of an image file's bytes, asked of PIL (the header only) when its first 64 KiB
    hold EXIF data: a JPEG's APP1 segment, a PNG's eXIf chunk, a flagged WebP. 1 without any: an
    untagged file costs one search of its head."""
    head = encoded[:65536].numpy().tobytes()
    if b"Exif\x00\x00" not in head and b"eXIf" not in head and not _is_tagged_webp(head):
        return 1
    return exif_orientation(encoded.numpy().tobytes())


def _turn_upright(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """(3, H, W) uint8 pixels as stored -> as viewers show them, for EXIF orientation 2..8 (the turns and
    flips of PIL's ``exif_transpose``). OpenCV does it on the (H, W, 3) layout torchvision decodes into:
    a tenth of what torchvision's own ``apply_exif_orientation`` plus a contiguous copy costs."""
    import cv2

    hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
    turned = {
        2: lambda a: cv2.flip(a, 1),
        3: lambda a: cv2.rotate(a, cv2.ROTATE_180),
        4: lambda a: cv2.flip(a, 0),
        5: cv2.transpose,
        6: lambda a: cv2.rotate(a, cv2.ROTATE_90_CLOCKWISE),
        7: lambda a: cv2.rotate(cv2.transpose(a), cv2.ROTATE_180),
        8: lambda a: cv2.rotate(a, cv2.ROTATE_90_COUNTERCLOCKWISE),
    }[orientation](hwc)
    return torch.from_numpy(turned).permute(2, 0, 1)


#: JPEG's start-of-frame markers, the segment that holds the image's size
_JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: memoryview) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame segment, reached by hopping over the segments before it."""
    at = 2
    while at + 9 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
        elif marker in _JPEG_FRAMES:
            return int.from_bytes(data[at + 7:at + 9], "big"), int.from_bytes(data[at + 5:at + 7], "big")
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            at += 2
        else:
            at += 2 + int.from_bytes(data[at + 2:at + 4], "big")
    return None


def header_size(data: memoryview) -> tuple[int, int] | None:
    """(width, height) that a PNG, JPEG or WebP file's header declares, read without decoding (the
    formats torchvision decodes; PIL checks the others itself); ``None`` for other or damaged headers."""
    head = bytes(data[:32])
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        chunk = head[12:16]
        if chunk == b"VP8X":
            return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
        if chunk == b"VP8 ":
            return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
        if chunk == b"VP8L":
            bits = int.from_bytes(head[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def pixel_limit() -> int | None:
    """The most pixels an image may have: where PIL refuses a file as a decompression bomb (twice
    ``PIL.Image.MAX_IMAGE_PIXELS``, about 179 million by default); ``None`` when that is switched off."""
    from PIL import Image

    return None if Image.MAX_IMAGE_PIXELS is None else 2 * int(Image.MAX_IMAGE_PIXELS)


def check_pixel_count(encoded: torch.Tensor, where: Path | str) -> None:
    """Refuse, before decoding, an image whose header declares more than :func:`pixel_limit` pixels: a
    few hundred kilobytes of PNG can decode into gigabytes (torchvision's decoders have no such limit)."""
    limit = pixel_limit()
    size = None if limit is None else header_size(memoryview(encoded.numpy()))
    if size is None or size[0] * size[1] <= limit:
        return
    width, height = size
    raise BadImageError(where, f"it is {width}x{height} = {width * height:,} pixels ({3 * width * height / 2**30:.1f} "
                               f"GiB decoded), over the limit of {limit:,} pixels (twice PIL.Image.MAX_IMAGE_PIXELS, "
                               "where PIL refuses decompression bombs). Downscale the file, or raise "
                               "PIL.Image.MAX_IMAGE_PIXELS if images this large are meant")


def _decode(encoded: torch.Tensor, where: Path | str) -> torch.Tensor:
    """(3, H, W) uint8 RGB, upright, of an image file's bytes (a 1-D uint8 tensor); ``where`` names it in errors.
    An image over :func:`pixel_limit` is refused before it is decoded."""
    from torchvision.io import ImageReadMode, decode_image

    check_pixel_count(encoded, where)
    orientation = _stored_orientation(encoded)
    try:
        # where no tag was found in the head, torchvision still applies one it finds (a late PNG chunk)
        image = _to_uint8(decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=orientation == 1))
    except Exception:  # torchvision does not decode every format PIL knows (TIFF, PPM, ...)
        try:
            return _read_with_pil(io.BytesIO(encoded.numpy().tobytes()))  # turns the image itself
        except Exception as err:  # PIL raises several types for truncated or foreign files
            raise BadImageError(where, str(err) or type(err).__name__) from err
    return image if orientation == 1 else _turn_upright(image, orientation)


def read_rgb(path: Path | str) -> torch.Tensor:
    """(3, H, W) uint8 RGB of an image file, upright (its EXIF orientation applied). Any decoding
    failure raises :class:`BadImageError` naming ``path``: a missing, empty, truncated or non-image file."""
    path = Path(path)
    if not path.is_file():
        raise BadImageError(path, "no such file")
    if path.stat().st_size == 0:
        raise BadImageError(path, "empty file (0 bytes)")
    try:
        encoded = torch.from_numpy(np.fromfile(path, np.uint8))
    except OSError as err:  # permissions, a file removed meanwhile
        raise BadImageError(path, str(err) or type(err).__name__) from err
    return _decode(encoded, path)


def decode_rgb_bytes(data: bytes | memoryview, where: str) -> torch.Tensor:
    """(3, H, W) uint8 RGB of an image file's bytes (a streamed sample's), decoded as :func:`read_rgb`
    decodes the file: upright, 16-bit scaled. Failures raise :class:`BadImageError` naming ``where``."""
    if len(data) == 0:
        raise BadImageError(where, "empty file (0 bytes)")
    return _decode(torch.from_numpy(np.frombuffer(data, np.uint8).copy()), where)


def read_rgb_array(path: Path | str) -> np.ndarray:
    """(H, W, 3) uint8 RGB, for pipelines working on numpy arrays (albumentations)."""
    return read_rgb(path).permute(1, 2, 0).numpy()


def guarded(read: Callable[[], object], path: Path | str, on_bad_image: OnBadImage):
    """Run ``read()``; an unreadable image returns ``None`` (logged with its path) under ``skip``."""
    try:
        return read()
    except BadImageError as err:
        if on_bad_image == "skip":
            log.warning("skipping %s", err)
            return None
        raise


def collate_skipping(batch: list, collate: Callable = default_collate):
    """Collate the items that are not ``None`` with ``collate`` and count the dropped ones.

    Dict batches get ``batch["skipped"]``; other batches are returned as they are, with the count
    in ``len(batch) - len(kept)`` left to the dataset's own collate. A batch whose items were all
    skipped is ``{"skipped": n}`` (tasks skip such a step)."""
    kept = [item for item in batch if item is not None]
    skipped = len(batch) - len(kept)
    if not kept:
        return {"skipped": skipped}
    out = collate(kept)
    if isinstance(out, dict):
        out["skipped"] = skipped
    return out
