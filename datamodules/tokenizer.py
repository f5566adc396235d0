"""A joint source/target sentencepiece model, trained once on the training split.

The model file is cached beside the data (``root/spm.<src>-<tgt>.<type><size>.model``)
or, when ``root`` is read-only, in the suite's data cache under a name derived from
the training files' content. Beside every model lies a record ``<model>.json`` of what
it was trained from: a fingerprint of the training files' content and the training
settings. A model whose record is missing or no longer matches (the training files were
replaced, or ``character_coverage`` changed) is retrained, with a log line saying why,
instead of being reused: a stale vocabulary turns every unseen word into ``⁇``.
Training runs under a file lock and lands atomically, so DDP ranks started together
train it once.

Hashing a WMT-sized training set (1.2 GB) on every start would cost seconds: the content hash
is remembered per file set (:func:`remembered_data_fingerprint`), keyed by what ``stat`` says of
each file, ctime included, so a file replaced in any way (even by ``cp -p``, which keeps the
modification time) is hashed again.

Special ids are fixed for every model the suite trains: pad 0, unk 1, bos 2, eos 3.

Text files are read as :class:`TextLines`: UTF-8, a byte order mark dropped, lines ended by
``\\n``, ``\\r\\n`` or (old Mac files) ``\\r``; the sentencepiece model is trained on those lines.

A :class:`Tokenizer` can also be rebuilt from its serialized model
(:meth:`Tokenizer.serialized` / :meth:`Tokenizer.from_serialized`), which is how a
checkpoint carries the vocabulary it was trained with; :attr:`Tokenizer.fingerprint`
names that vocabulary.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import itertools
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from datamodules.demo import cache_home

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

#: sentences sentencepiece samples from the training files (part of a model's training record)
INPUT_SENTENCE_SIZE = 2_000_000


class Tokenizer:
    """Thin wrapper over a ``SentencePieceProcessor``: text <-> ids, no special tokens added.

    ``Tokenizer(model_file)`` reads a ``.model`` file; ``Tokenizer.from_serialized(data)``
    builds one from the model's bytes (``model_file`` is then ``None``).
    """

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_file: str | os.PathLike):
        self.model_file: Path | None = Path(model_file)
        self._load(spm.SentencePieceProcessor(model_file=str(model_file)), str(model_file))

    @classmethod
    def from_serialized(cls, data: bytes) -> Tokenizer:
        """The tokenizer whose :meth:`serialized` model proto is ``data``."""
        tokenizer = cls.__new__(cls)
        tokenizer.model_file = None
        try:
            sp = spm.SentencePieceProcessor(model_proto=bytes(data))
        except RuntimeError as err:  # sentencepiece reports a bad proto as an internal error
            raise ValueError(f"not a serialized sentencepiece model ({len(data)} bytes): {err}") from None
        tokenizer._load(sp, "serialized sentencepiece model")
        return tokenizer

    def _load(self, sp: spm.SentencePieceProcessor, origin: str) -> None:
        if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(f"{origin}: special ids must be pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}, "
                             f"got pad={sp.pad_id()} unk={sp.unk_id()} bos={sp.bos_id()} eos={sp.eos_id()}")
        self.sp = sp
        self._fingerprint: str | None = None

    def serialized(self) -> bytes:
        """The sentencepiece model proto: everything :meth:`from_serialized` needs."""
        return self.sp.serialized_model_proto()

    @property
    def fingerprint(self) -> str:
        """Identifies the vocabulary: the first 16 hex digits of the sha256 of :meth:`serialized`.
        Equal for a model file and the tokenizer rebuilt from its bytes."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self.serialized()).hexdigest()[:16]
        return self._fingerprint

    @property
    def content_fingerprint(self) -> str:
        """Identifies what the vocabulary does, not where it was trained: :attr:`fingerprint` of the model
        with the training files' paths, ``model_prefix`` and ``num_threads`` cleared (sentencepiece records
        them in the model), so the vocabulary trained from an identical copy of the data in another folder,
        or on a machine with other cores, is the same one. What a checkpoint is compared with."""
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.serialized())
        model.trainer_spec.ClearField("input")
        model.trainer_spec.ClearField("model_prefix")
        model.trainer_spec.ClearField("num_threads")
        return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def encode_flat(self, texts: Sequence[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)``: the ids of all ``texts`` end to end, (sum of lengths,) int32, and each
        text's number of ids, (N,) int64, encoded by ``num_threads`` sentencepiece threads. The ids
        go straight into one array: the lists sentencepiece returns live for one call, not one
        numpy array per text for the whole corpus."""
        encoded = self.sp.encode(list(texts), out_type=int, num_threads=num_threads)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum()))
        return ids, lengths

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Detokenize; pad/bos/eos are dropped and decoding stops at the first eos."""
        out = []
        for seq in ids:
            seq = [int(i) for i in seq]
            if EOS_ID in seq:
                seq = seq[: seq.index(EOS_ID)]
            out.append(self.sp.decode([i for i in seq if i not in (PAD_ID, BOS_ID)]))
        return out

    # picklable for DataLoader workers. The model's bytes travel, not the file name: a model
    # file retrained meanwhile must not change the vocabulary of a tokenizer already in use.
    def __getstate__(self):
        return {"model_file": self.model_file, "model_proto": self.serialized()}

    def __setstate__(self, state):
        self.__dict__.update(Tokenizer.from_serialized(state["model_proto"]).__dict__)
        self.model_file = state["model_file"]


# ---------------------------------------------------------------------------------------------
# reading text files
# ---------------------------------------------------------------------------------------------
BOM = b"\xef\xbb\xbf"
LF, CR = 10, 13


def _positions(data: np.ndarray, byte: int, block: int = 1 << 26) -> np.ndarray:
    """Positions of ``byte`` in ``data`` (uint8), in blocks so a 1 GB file needs no 1 GB mask."""
    found = [np.flatnonzero(data[at : at + block] == byte) + at for at in range(0, len(data), block)]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


class TextLines:
    """The lines of UTF-8 text ``data`` (uint8 array, e.g. a memory-mapped file), found without decoding it.

    A leading byte order mark (U+FEFF) is not part of the first line. Lines end with ``\\n``, and one
    ``\\r`` before it is dropped (Windows files); a text without any ``\\n`` but with ``\\r`` is an old
    Mac file, whose lines end with ``\\r``. A ``\\r`` inside a line of a ``\\n`` file stays in its line:
    splitting there would shift every later pair of a parallel corpus by one.

    ``starts``/``ends`` (N,) int64: byte span of line i (line break excluded); ``decode(a, b)`` gives
    lines a..b-1 as strings, a non-UTF-8 byte raising ``ValueError`` that names ``name`` and the line.
    """

    def __init__(self, data: np.ndarray, name: str):
        self.data, self.name = data, name
        self.bom = data[:3].tobytes() == BOM
        first = 3 if self.bom else 0
        breaks = _positions(data, LF)
        self.separator = "\n"
        if not len(breaks):
            cr = _positions(data, CR)
            if len(cr):
                breaks, self.separator = cr, "\r"
        ends = breaks
        if len(data) > first and (not len(breaks) or breaks[-1] != len(data) - 1):
            ends = np.append(breaks, len(data))  # a last line without a line break
        self.starts = np.concatenate([[first], breaks[: len(ends) - 1] + 1]).astype(np.int64) if len(ends) else ends
        self.ends = ends.astype(np.int64)
        self.crlf = 0
        if self.separator == "\n" and len(ends):
            windows = (self.ends > self.starts) & (data[np.maximum(self.ends - 1, 0)] == CR)
            self.ends -= windows.astype(np.int64)
            self.crlf = int(windows.sum())

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> TextLines:
        """The lines of a file, memory-mapped (pages are read as lines are decoded)."""
        empty = Path(path).stat().st_size == 0  # numpy cannot map an empty file
        data = np.zeros(0, np.uint8) if empty else np.memmap(path, dtype=np.uint8, mode="r")
        return cls(data, str(path))

    @property
    def normalized(self) -> bool:
        """Whether reading changed anything but ``\\n`` line breaks (a BOM, ``\\r\\n`` or ``\\r``)."""
        return self.bom or self.crlf > 0 or self.separator == "\r"

    def __len__(self) -> int:
        return len(self.starts)

    def decode(self, first: int = 0, stop: int | None = None) -> list[str]:
        stop = len(self) if stop is None else stop
        if stop <= first:
            return []
        # one decode for the block of lines, then one split: no Python call per line but the last strip
        begin, end = int(self.starts[first]), int(self.ends[stop - 1])
        if self.crlf and end < len(self.data) and self.data[end] == CR:
            end += 1  # the block keeps every line's "\r\n" "\r", dropped below line by line alike
        block = self.data[begin:end].tobytes()
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError as err:
            at = begin + err.start
            line = int(np.searchsorted(self.starts, at, side="right"))
            raise ValueError(f"{self.name}: line {line} is not valid UTF-8 ({err.reason} at byte {at})") from None
        lines = text.split(self.separator)
        if self.crlf:
            lines = [line[:-1] if line.endswith("\r") else line for line in lines]
        return lines

    def chunks(self, size: int) -> Iterator[list[str]]:
        """The lines, ``size`` at a time."""
        for first in range(0, len(self), size):
            yield self.decode(first, min(first + size, len(self)))


def decode_lines(data: bytes, name: str) -> list[str]:
    """The lines of UTF-8 ``data`` as :class:`TextLines` reads them (``name`` is what errors call it)."""
    return TextLines(np.frombuffer(data, dtype=np.uint8), name).decode()


def read_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a (small) UTF-8 file as :class:`TextLines` reads them; a byte sequence that is not
    UTF-8 raises ``ValueError`` naming the file and the 1-based line."""
    return TextLines.of_file(path).decode()


# ---------------------------------------------------------------------------------------------
# training and caching
# ---------------------------------------------------------------------------------------------
def data_fingerprint(files: Sequence[Path], chunk_size: int = 1 << 20) -> str:
    """sha256 (hex) of the training files' content: each file's size, then its bytes, in order.

    The whole content is hashed, in ``chunk_size`` pieces so a 1 GB WMT file never sits in
    memory. This is exact where the cheaper size + mtime + first/last MiB key is not: a
    cleaned or re-filtered corpus can keep its head and tail, ``cp -p``/``rsync -t`` keep
    mtimes while a plain copy or ``touch`` changes them without changing the text. The
    cost is one sequential read (about 1 s per GB); :func:`remembered_data_fingerprint` pays it
    once per change of the files, not on every start. File names are left out, so the same
    corpus under another path has the same fingerprint.
    """
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as stream:
            h.update(f"{os.fstat(stream.fileno()).st_size}\n".encode())
            while chunk := stream.read(chunk_size):
                h.update(chunk)
    return h.hexdigest()


#: a file changed this recently before it was hashed is hashed again on the next start: a change
#: within the same timestamp tick as the recorded one could otherwise go unseen (git's "racy" files)
RACY_SECONDS = 2.0


def _stat_key(path: Path) -> list:
    st = os.stat(path)
    return [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def remembered_data_fingerprint(files: Sequence[Path]) -> str:
    """:func:`data_fingerprint` of ``files``, remembered in the data cache per set of files.

    The remembered hash is reused while every file has the same device, inode, size, mtime and
    ctime. A replaced or rewritten file gets a new ctime whatever keeps its mtime (``cp -p``,
    ``rsync -t``, ``touch -d``): the kernel sets ctime on every change and no call sets it back. So
    a later start stats the files instead of reading 1.2 GB, and changed data is still hashed."""
    files = [Path(f) for f in files]
    keys = [_stat_key(f) for f in files]
    memo = cache_home() / "tokenizers" / "content-hashes" / (
        hashlib.sha256(json.dumps([k[0] for k in keys]).encode()).hexdigest()[:16] + ".json")
    try:
        saved = json.loads(memo.read_text())
        if saved["files"] == keys:
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    started = time.time_ns()
    digest = data_fingerprint(files)
    settled = all(max(k[4], k[5]) < started - RACY_SECONDS * 1e9 for k in keys)
    if settled and [_stat_key(f) for f in files] == keys:  # unchanged while it was read
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(memo, json.dumps({"files": keys, "sha256": digest}).encode())
        except OSError:  # a read-only cache costs a hash per start, nothing else
            pass
    return digest


def record_file(model_file: Path) -> Path:
    """Where the training record of ``model_file`` lives: ``<model>.json``."""
    return model_file.with_name(model_file.name + ".json")


def _stale_reason(model_file: Path, record: dict) -> str | None:
    """Why ``model_file`` cannot be reused for ``record`` (None: it can)."""
    if not model_file.is_file():
        return "it does not exist"
    path = record_file(model_file)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path.name} (the record of the data it was trained from) is missing"
    except (OSError, ValueError) as err:
        return f"{path.name} is unreadable ({err})"
    if saved.get("data_sha256") != record["data_sha256"]:
        return f"the training files changed since it was trained ({', '.join(record['files'])})"
    changed = [f"{k}={saved.get(k)!r} -> {v!r}" for k, v in record.items() if k != "files" and saved.get(k) != v]
    if changed:
        return f"the training settings changed ({', '.join(changed)})"
    return None


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_sentencepiece(
    files: Iterable[Path],
    model_file: Path,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = INPUT_SENTENCE_SIZE,
) -> Path:
    """Train a joint model on the lines of ``files`` and write it to ``model_file`` atomically.

    ``vocab_size`` is an upper bound (a small corpus may not support it; the model then
    gets as many pieces as the data allow instead of failing).
    """
    files = [Path(f) for f in files]
    sides = [TextLines.of_file(f) for f in files]
    if any(lines.normalized for lines in sides):
        # sentencepiece splits files at "\n" alone: give it the lines as the datamodule reads them
        source = {"sentence_iterator": (line for lines in sides for chunk in lines.chunks(100_000) for line in chunk)}
    else:
        source = {"input": [str(f) for f in files]}
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        **source,
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        hard_vocab_limit=False,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        num_threads=max(1, min(16, os.cpu_count() or 1)),
        minloglevel=2,
    )
    model_file.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(model_file, buffer.getvalue())
    return model_file


def joint_tokenizer(
    train_files: Sequence[Path],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    name: str = "spm",
) -> Tokenizer:
    """The joint model for the current content of ``train_files``, trained when there is none
    or the cached one was trained from other data or with other settings.

    Raises ``ValueError`` when a training file is empty (nothing to train on).
    """
    train_files = [Path(f) for f in train_files]
    for f in train_files:
        if f.stat().st_size == 0:
            raise ValueError(f"{f} is empty: it has no sentences to train the sentencepiece model on")
    data_sha256 = remembered_data_fingerprint(train_files)
    record = {"data_sha256": data_sha256, "files": [f.name for f in train_files], "vocab_size": vocab_size,
              "model_type": model_type, "character_coverage": character_coverage,
              "input_sentence_size": INPUT_SENTENCE_SIZE}
    stem = f"{name}.{model_type}{vocab_size}"
    beside = train_files[0].parent / f"{stem}.model"
    if _stale_reason(beside, record) is None:
        return Tokenizer(beside)
    if os.access(beside.parent, os.W_OK):
        target = beside
    else:
        # read-only dataset: the cached model is named after the data it is trained from
        target = cache_home() / "tokenizers" / f"{stem}.{data_sha256[:16]}.model"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait while one trains, then find it fresh
        reason = _stale_reason(target, record)
        if reason is not None:
            if target.is_file():
                log.warning("retraining the sentencepiece model %s: %s", target, reason)
            else:
                log.info("training the sentencepiece model %s on %s", target, ", ".join(map(str, train_files)))
            train_sentencepiece(train_files, target, vocab_size, model_type, character_coverage)
            # the record is written after the model: a reader that sees a matching record finds the new model
            _write_atomically(record_file(target), (json.dumps(record, indent=1) + "\n").encode())
    return Tokenizer(target)
