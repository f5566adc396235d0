"""Parallel plain-text translation data (WMT layout) with token-based batching.

``root/<split>.<src_lang>`` and ``root/<split>.<tgt_lang>`` for the splits train, valid
and test (``train.en`` / ``train.de``, ...): one sentence per line, UTF-8, line i of the
source file translates line i of the target file. A byte order mark is ignored and lines may
end with ``\\n``, ``\\r\\n`` or ``\\r`` (:class:`datamodules.tokenizer.TextLines`), in the splits and
in ``predict_path`` alike. Missing files, files of different lengths, empty files and non-UTF-8
lines are refused with errors naming the files (and the line). With no ``root`` the demo corpus
of :mod:`datamodules.demo_text` is built once and read the same way.

Each split is tokenized once into a prepared index (:mod:`datamodules.prepared`): the token ids
of all its lines as one flat array with offsets, and the raw text as bytes with line spans. The
first start builds it (sentencepiece's threads, a chunk of lines at a time); every later start,
DDP rank and loader worker maps it read-only, and the dataset decodes only the lines of a batch.
A changed file or vocabulary rebuilds it; ``max_positions`` filters at load, without one.

Batches hold as many sentences as fit into ``max_tokens`` padded tokens per side
(``batch size x longest sentence <= max_tokens``, fairseq's convention), built from
length-sorted sentences so little is padding. Training batches are re-drawn every
epoch from ``seed + epoch`` (ties in length broken randomly, batch order shuffled)
and, after a restart from a checkpoint taken within an epoch, skip the sentences already
trained on (the training loader is stateful, :mod:`datamodules.resumable`; sentences are
tokenized once, without sampling, so a sentence is the same tensor whenever it is drawn:
resuming replays the uninterrupted run exactly);
evaluation batches are fixed. Under DDP the datamodule shards batches itself:
training ranks get disjoint batches (the same number on each rank), evaluation ranks
get disjoint sentences that together cover each sentence exactly once. Run with
``trainer.use_distributed_sampler=false`` (the recipes set it) so Lightning does not
shard a second time (it refuses to, naming that setting: it cannot put its sampler into
these batches).

A batch is a dict:
    ``src`` (B, S) source ids ending in eos, pad-filled;
    ``tgt_in`` (B, T) bos + target ids (decoder input); ``tgt_out`` (B, T) target ids + eos;
    ``index`` (B,) line numbers in the split; ``src_text``/``tgt_text`` the raw lines.
Predict batches are raw text, ``{"index": (B,) line numbers, "src_text": B lines}``, read
from ``predict_path`` alone: the model tokenizes them with the tokenizer in its checkpoint.
"""
from __future__ import annotations

import base64
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules.demo_text import demo_translation_root
from datamodules.loaders import StreamedSource, check_positive_counts
from datamodules.resumable import EpochOrder, ResumableLoader
from datamodules.prepared import PreparedIndex, file_signature, prepare
from datamodules.tokenizer import (BOS_ID, EOS_ID, PAD_ID, TextLines, Tokenizer, decode_lines, joint_tokenizer,
                                   read_lines)
from layers.machine import AUTO, NumWorkers, loader_workers

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# reading: every split is tokenized once into a prepared index that all ranks and workers map
# ---------------------------------------------------------------------------------------------
#: bump when what a prepared WMT index holds, or how its lines are read, changes
INDEX_VERSION = 1
#: lines tokenized at a time while preparing: bounds the memory of the Python strings in flight
ENCODE_CHUNK = 100_000


def read_parallel(src_path: Path, tgt_path: Path) -> tuple[list[str], list[str]]:
    """Both files' lines as lists (small files: demo data, benchmarks); different counts raise."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    _check_counts(src_path, len(src), tgt_path, len(tgt))
    return src, tgt


def _check_counts(src_path, src_count: int, tgt_path, tgt_count: int) -> None:
    if src_count != tgt_count:
        raise ValueError(f"parallel files differ in length: {src_path} has {src_count} lines, "
                         f"{tgt_path} has {tgt_count} lines")


def _join(chunks: list[np.ndarray], dtype) -> np.ndarray:
    """``np.concatenate`` that frees each chunk once copied: about one copy in memory at a time, not two."""
    out = np.empty(sum(len(chunk) for chunk in chunks), dtype=dtype)
    at = 0
    while chunks:
        chunk = chunks.pop(0)
        out[at : at + len(chunk)] = chunk
        at += len(chunk)
    return out


def build_index(src_path: Path, tgt_path: Path, tokenizer: Tokenizer, split: str) -> tuple[dict, dict]:
    """The prepared index of one split: ``(arrays, meta)`` for :func:`datamodules.prepared.prepare`.

    Arrays (N pairs): ``tokens``, the ids of every source line then every target line, uint16 when
    the vocabulary fits (int32 otherwise); ``src_offsets``/``tgt_offsets`` (N + 1,) int64, line i's
    ids are ``tokens[offsets[i]:offsets[i + 1]]``; ``src_blank``/``tgt_blank`` (N,) bool, the line is
    empty or whitespace; ``src_text``/``tgt_text`` the files' bytes with ``*_starts``/``*_ends`` (N,)
    int64, line i's byte span (line break and BOM excluded).

    Lines are tokenized :data:`ENCODE_CHUNK` at a time by sentencepiece's threads, so memory holds
    one chunk's strings and the arrays, never a Python object per line of the corpus."""
    sides = TextLines.of_file(src_path), TextLines.of_file(tgt_path)
    _check_counts(src_path, len(sides[0]), tgt_path, len(sides[1]))
    if not len(sides[0]):  # otherwise Lightning's generic "length of DataLoader is zero"
        raise ValueError(f"{src_path} and {tgt_path} are empty: the {split} split has no sentences")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    threads = max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    arrays, tokens, start = {}, [], 0
    for side, lines in zip(("src", "tgt"), sides):
        lengths, blank = [], []
        for texts in lines.chunks(ENCODE_CHUNK):
            ids, counts = tokenizer.encode_flat(texts, num_threads=threads)
            tokens.append(ids.astype(dtype))
            lengths.append(counts)
            blank.append(np.fromiter((not text.strip() for text in texts), dtype=bool, count=len(texts)))
        offsets = np.zeros(len(lines) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        arrays[f"{side}_offsets"] = offsets + start
        start += int(offsets[-1])
        arrays[f"{side}_blank"] = np.concatenate(blank)
        arrays.update({f"{side}_text": lines.data, f"{side}_starts": lines.starts, f"{side}_ends": lines.ends})
    arrays["tokens"] = _join(tokens, dtype)
    meta = {"lines": len(sides[0]), "tokenizer": tokenizer.fingerprint, "dtype": np.dtype(dtype).name,
            "source": str(src_path), "target": str(tgt_path)}
    return arrays, meta


def index_fingerprint(src_path: Path, tgt_path: Path, tokenizer: Tokenizer) -> dict:
    """What a prepared index depends on: the files (size, mtime and ctime: a file replaced with its
    mtime kept still gets a new ctime), the vocabulary and the index layout. Not ``max_positions``:
    filtering happens when the index is loaded."""
    def signature(path: Path) -> dict:
        return {**file_signature(path), "ctime_ns": path.stat().st_ctime_ns, "path": str(path.resolve())}

    return {"wmt_index": INDEX_VERSION, "src": signature(src_path), "tgt": signature(tgt_path),
            "tokenizer": tokenizer.fingerprint}


def prepare_split(src_path: Path, tgt_path: Path, tokenizer: Tokenizer, split: str,
                  prepared_dir: str | None = None) -> PreparedIndex:
    """The prepared index of the pair of files (built once, then memory-mapped)."""
    # keyed by the pair (not the source file alone): en-de and en-fr beside one train.en do not evict each other
    pair = src_path.parent / f"{src_path.name}-{tgt_path.suffix.lstrip('.')}"
    return prepare("wmt", pair, index_fingerprint(src_path, tgt_path, tokenizer),
                   lambda: build_index(src_path, tgt_path, tokenizer, split), prepared_dir)


class Lines:
    """The raw lines of one side of a prepared index, decoded one at a time from its mapped bytes."""

    def __init__(self, index: PreparedIndex, side: str):
        self.data, self.starts, self.ends = index[f"{side}_text"], index[f"{side}_starts"], index[f"{side}_ends"]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, line: int) -> str:
        return self.data[int(self.starts[line]) : int(self.ends[line])].tobytes().decode("utf-8")


def warn_blank_evaluation_lines(index: PreparedIndex, name: str) -> None:
    """Say which evaluation pairs have an empty (or whitespace) side: they are scored as they are, since
    leaving them out would change the test set, but an empty reference turns every word of its
    hypothesis into an error, which a misaligned or damaged file often is the cause of."""
    blank_src, blank_tgt = np.asarray(index["src_blank"]), np.asarray(index["tgt_blank"])
    lines = np.flatnonzero(blank_src | blank_tgt) + 1
    if not len(lines):
        return
    shown = ", ".join(str(n) for n in lines[:10]) + (", ..." if len(lines) > 10 else "")
    log.warning("%s: %d of %d pairs have an empty side (%d empty references, %d empty sources; line %s); they are "
                "scored as they are: an empty reference counts its whole hypothesis as wrong. Remove such pairs "
                "from both files to leave them out of the score", name, len(lines), len(blank_src),
                int(blank_tgt.sum()), int(blank_src.sum()), shown)


class ParallelText(Dataset):
    """Tokenized pairs of one split, read from its prepared index (:func:`prepare_split`).
    Item i -> (line, src ids + eos (S,) int64, target ids (T,) int64, raw src, raw tgt).

    Training drops pairs with an empty side or more than ``max_positions - 1`` tokens on a side
    (counted in a warning); evaluation keeps every line, cuts long sources and warns about empty sides. Both work on the
    index's length arrays, so another ``max_positions`` needs no new tokenization. The dataset
    holds arrays only (the mapped index, kept line numbers, lengths): forked loader workers share
    them instead of copying millions of Python objects."""

    def __init__(self, index: PreparedIndex, max_positions: int, *, training: bool, name: str = ""):
        self.tokens = index["tokens"]
        self.src_offsets, self.tgt_offsets = index["src_offsets"], index["tgt_offsets"]
        self.src_lines, self.tgt_lines = Lines(index, "src"), Lines(index, "tgt")
        src_len, tgt_len = np.diff(self.src_offsets), np.diff(self.tgt_offsets)
        total = len(src_len)
        # the decoder sees bos + target and predicts target + eos: T = len(target) + 1 positions
        limit = max_positions - 1
        if training:
            empty = np.asarray(index["src_blank"]) | np.asarray(index["tgt_blank"])
            long = (src_len > limit) | (tgt_len > limit)
            keep = np.flatnonzero(~(empty | long))
            dropped = total - len(keep)
            if dropped:
                log.warning("%s: dropped %d of %d pairs (%d empty, %d longer than %d tokens)", name, dropped, total,
                            empty.sum(), long.sum(), limit)
            if not len(keep):  # otherwise Lightning's generic "length of DataLoader is zero"
                raise ValueError(f"{name}: none of the {total} pairs can be trained on ({empty.sum()} empty, "
                                 f"{long.sum()} longer than {limit} tokens)")
        else:
            # every evaluation line is scored; over-long sources are cut, not dropped
            keep = np.arange(total)
            cut = int((src_len > limit).sum())
            if cut:
                log.warning("%s: %d of %d source lines truncated to %d tokens", name, cut, total, limit)
            warn_blank_evaluation_lines(index, name)
        self.index = keep.astype(np.int64)
        self.src_lengths = (np.minimum(src_len[keep], limit) + 1).astype(np.int32)  # eos included
        self.tgt_lengths = (np.minimum(tgt_len[keep], limit) + 1).astype(np.int32)  # eos (or bos) included

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        line = int(self.index[i])
        n, start = int(self.src_lengths[i]) - 1, int(self.src_offsets[line])
        src = np.empty(n + 1, dtype=np.int64)
        src[:n] = self.tokens[start : start + n]
        src[n] = EOS_ID
        start = int(self.tgt_offsets[line])
        tgt = self.tokens[start : start + int(self.tgt_lengths[i]) - 1].astype(np.int64)
        return line, src, tgt, self.src_lines[line], self.tgt_lines[line]

    @property
    def num_tokens(self) -> np.ndarray:
        """Padded positions a sentence costs in a batch: the longer of its two sides."""
        return np.maximum(self.src_lengths, self.tgt_lengths)


class StoredPairs:
    """One split as ``python -m datamodules.optimize`` stores it: a LitData sample per line
    (``stored_sample``) and, beside the samples, the split's prepared index (``store_beside``),
    which is what a streamed training reads."""

    def __init__(self, index: PreparedIndex):
        self.prepared = index
        self.src, self.tgt = Lines(index, "src"), Lines(index, "tgt")

    def __len__(self) -> int:
        return len(self.src)

    def stored_sample(self, index: int) -> dict:
        return {"index": index, "src": self.src[index], "tgt": self.tgt[index]}

    def store_beside(self, output: str, folder: str) -> dict:
        from datamodules.streaming import write_prepared

        return write_prepared(self.prepared, output, f"{folder}.tokens")


def collate(items) -> dict:
    index, src, tgt, src_text, tgt_text = zip(*items)
    b = len(items)
    src_len = max(len(s) for s in src)
    tgt_len = max(len(t) for t in tgt) + 1
    src_ids = torch.full((b, src_len), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((b, tgt_len), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((b, tgt_len), PAD_ID, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src, tgt)):
        src_ids[i, : len(s)] = torch.from_numpy(s)
        tgt_in[i, 0] = BOS_ID
        tgt_in[i, 1 : len(t) + 1] = torch.from_numpy(t)
        tgt_out[i, : len(t)] = torch.from_numpy(t)
        tgt_out[i, len(t)] = EOS_ID
    return {"src": src_ids, "tgt_in": tgt_in, "tgt_out": tgt_out, "index": torch.tensor(index),
            "src_text": list(src_text), "tgt_text": list(tgt_text)}


def collate_text(items: Sequence[tuple[int, str]]) -> dict:
    """Predict batches stay raw text: ``index`` (B,) long line numbers, ``src_text`` the B lines.
    The model tokenizes them with the tokenizer stored in its checkpoint."""
    index, text = zip(*items)
    return {"index": torch.tensor(index, dtype=torch.long), "src_text": list(text)}


# ---------------------------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------------------------
def pack_by_tokens(order: np.ndarray, num_tokens: np.ndarray, max_tokens: int,
                   max_sentences: int | None = None) -> list[np.ndarray]:
    """Cut ``order`` (indices, usually length-sorted) into consecutive batches whose
    ``len(batch) * max(num_tokens[batch]) <= max_tokens``. A sentence longer than
    ``max_tokens`` on its own gets a batch of one."""
    batches, start, longest = [], 0, 0
    for pos, idx in enumerate(order):
        n = int(num_tokens[idx])
        new_longest = max(longest, n)
        size = pos - start + 1
        if pos > start and (size * new_longest > max_tokens or (max_sentences and size > max_sentences)):
            batches.append(order[start:pos])
            start, new_longest = pos, n
        longest = new_longest
    if start < len(order):
        batches.append(order[start:])
    return batches


class TokenBatchSampler(EpochOrder, Sampler[list[int]]):
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, sharded over ranks.

    ``shuffle=True`` (training): every epoch, a permutation seeded by ``seed + epoch`` breaks
    length ties before sorting, the packed batches are shuffled, and rank r takes batches
    r, r + R, ... of the first ``R * floor(n / R)`` (equal step counts on all ranks). Iteration
    starts after the first ``start`` sentences of the epoch's batches (all ranks together), which
    :class:`TokenBatchLoader` sets from the position Lightning saved; ``len`` stays the whole epoch.

    ``shuffle=False`` (evaluation): sentences, not batches, are dealt out, so rank r
    evaluates sentences r, r + R, ... of the length-sorted order: every sentence exactly
    once over all ranks, no padding duplicates.
    """

    def __init__(self, num_tokens: np.ndarray, max_tokens: int, *, shuffle: bool, seed: int = 0,
                 num_replicas: int = 1, rank: int = 0, max_sentences: int | None = None):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_tokens = np.asarray(num_tokens)
        self.max_tokens = max_tokens
        self.max_sentences = max_sentences
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.start = 0
        self._cached: tuple[int, list[np.ndarray]] | None = None
        # Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``
        self.sampler = self

    def all_batches(self) -> list[np.ndarray]:
        """The current epoch's batches of all ranks (arrays of dataset indices): rank r's are r, r + R, ..."""
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self._make_batches())
        return self._cached[1]

    def batches(self) -> list[np.ndarray]:
        """This rank's batches for the current epoch."""
        if not self.shuffle:
            return self.all_batches()
        return self.all_batches()[self.rank :: self.num_replicas]

    def _make_batches(self) -> list[np.ndarray]:
        n = len(self.num_tokens)
        if not self.shuffle:
            order = np.argsort(self.num_tokens, kind="stable")[self.rank :: self.num_replicas]
            return pack_by_tokens(order, self.num_tokens, self.max_tokens, self.max_sentences)
        rng = np.random.default_rng([self.seed, self.epoch])
        perm = rng.permutation(n)
        order = perm[np.argsort(self.num_tokens[perm], kind="stable")]
        batches = pack_by_tokens(order, self.num_tokens, self.max_tokens, self.max_sentences)
        batches = [batches[i] for i in rng.permutation(len(batches))]
        usable = len(batches) // self.num_replicas * self.num_replicas
        return batches[:usable]

    def _sentences_before(self) -> np.ndarray:
        """Sentences of all ranks before each round of batches (round k: every rank's k-th batch)."""
        sizes = [len(b) for b in self.all_batches()]
        rounds = np.add.reduceat(sizes, np.arange(0, len(sizes), self.num_replicas)) if sizes else np.zeros(0, int)
        return np.concatenate([[0], np.cumsum(rounds)])

    def skipped(self) -> int:
        """This rank's batches before ``start``: the rounds of batches whose sentences have all been trained on
        (with other ``max_tokens`` than the position was counted with, as many sentences of the new batches)."""
        if not self.start:
            return 0
        return int(np.searchsorted(self._sentences_before(), self.start, side="right")) - 1

    def samples_after(self, batches: int) -> int:
        if not self.shuffle:
            return 0
        before = self._sentences_before()
        return int(before[min(self.skipped() + batches, len(before) - 1)])

    def __iter__(self) -> Iterator[list[int]]:
        # a generator: the epoch's batches are made at the first fetch, after Lightning's ``set_epoch``; a resume
        # from a checkpoint written at an epoch's end creates the loader's iterator before it sets the next epoch,
        # and a list made here trained that epoch on the previous epoch's batches
        skip = self.skipped() if self.shuffle else 0
        for batch in self.batches()[skip:]:
            yield batch.tolist()

    def __len__(self) -> int:
        return len(self.batches())


class TokenBatchLoader(ResumableLoader, DataLoader):
    """The training loader of token batches: its position in the epoch (sentences) is saved in checkpoints."""

    @property
    def batch_setting(self) -> int:
        return self.batch_sampler.max_tokens


# ---------------------------------------------------------------------------------------------
# the datamodule
# ---------------------------------------------------------------------------------------------
class TranslationDataModule(StreamedSource, LightningDataModule):
    """WMT-style parallel text with a joint sentencepiece vocabulary.

    Args:
        root: folder with ``<split>.<src_lang>`` / ``<split>.<tgt_lang>`` for the train,
            valid and test splits (``train.en``, ``train.de``, ...); ``None`` builds the
            demo corpus (pycountry/babel translations) for the language pair.
        src_lang, tgt_lang: file suffixes of the two sides.
        vocab_size: size of the joint sentencepiece model (an upper bound for tiny corpora).
        spm_model_type: ``unigram`` or ``bpe``.
        character_coverage: sentencepiece's share of characters kept as pieces (1.0 for
            small corpora, 0.9999 for WMT-sized ones).
        max_tokens: padded tokens per side per batch and device (see the recipes for the
            rule that keeps tokens per optimizer step constant over device counts).
        eval_max_tokens: the same for validation/test (default: ``max_tokens``).
        max_positions: the longest sequence the model accepts (bos/eos included);
            longer training pairs are dropped (counted in the log), longer evaluation
            sources truncated.
        predict_path: text file (or ``-`` for standard input) that ``predict`` translates.
            Giving it makes this a predict-only datamodule: predict batches are raw text
            (the model tokenizes with the tokenizer in its checkpoint), and nothing reads
            ``root`` or loads/trains a tokenizer, so predict needs no dataset;
            ``vocab_size`` and ``vocabulary_fingerprint`` are then ``None``.
        predict_batch_size: sentences per ``predict`` batch (kept in file order).
        streaming_root: a folder or object-store URL written by ``python -m datamodules.optimize --task
            translate``; the splits' token arrays (their prepared indexes, stored beside the LitData
            samples) and the sentencepiece model are then read from it, and ``root`` is not read. A folder's
            arrays are mapped where they lie; an object store's are copied once into the local prepared cache
            (``prepared_dir``). Batching is the same as from files. ``vocab_size`` and the tokenizer settings
            are the optimized dataset's (:mod:`datamodules.streaming`).
        prepared_dir: where the splits' prepared indexes live (token ids, lengths and raw text as
            flat arrays, tokenized once and memory-mapped by every later start, rank and worker; see
            :mod:`datamodules.prepared`). Default: ``$SUITE_PREPARED_DIR``, else ``prepared/`` in the
            suite's data cache. The dataset folder itself may be read-only.
    """

    streaming_task, streaming_layout = "translate", "translation"

    def __init__(
        self,
        root: str | None = None,
        src_lang: str = "en",
        tgt_lang: str = "de",
        vocab_size: int = 8000,
        spm_model_type: str = "unigram",
        character_coverage: float = 1.0,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_positions: int = 256,
        num_workers: NumWorkers = AUTO,
        seed: int = 0,
        train_split: str = "train",
        valid_split: str = "valid",
        test_split: str = "test",
        predict_path: str | None = None,
        predict_batch_size: int = 32,
        streaming_root: str | None = None,
        prepared_dir: str | None = None,
    ):
        super().__init__()
        # Not given to the logger: ``vocab_size`` here is an upper bound, the model's is what the corpus
        # filled, and Lightning refuses to log two different values under one key. The logger gets the
        # whole resolved config from the CLI instead (``suite_config.yaml``), the checkpoint these.
        self.save_hyperparameters(logger=False)
        check_positive_counts(max_tokens=max_tokens, eval_max_tokens=eval_max_tokens,
                              predict_batch_size=predict_batch_size)
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.max_positions = max_positions
        self.num_workers = num_workers
        self.seed = seed
        self.splits = {"fit": train_split, "validate": valid_split, "test": test_split}
        self.predict_path = predict_path
        self.predict_batch_size = predict_batch_size
        self._root = Path(root) if root is not None else None
        self._tokenizer: Tokenizer | None = None
        self._predict_lines: list[str] | None = None  # standard input can be read only once
        self.datasets: dict[str, ParallelText] = {}
        self._streamed = None

    def reads_streamed(self) -> bool:
        return self.hparams.streaming_root is not None and self.predict_path is None

    def check_streamed(self, streamed) -> None:
        wanted = {**self._vocabulary_settings(), "src_lang": self.src_lang, "tgt_lang": self.tgt_lang}
        stored = {key: streamed.data[key] for key in wanted}
        if stored != wanted:
            differ = ", ".join(f"{key}={stored[key]!r} (data.{key}={wanted[key]!r})"
                               for key in wanted if stored[key] != wanted[key])
            raise ValueError(f"data.streaming_root={streamed.root} was optimized with {differ}: convert it with "
                             "the training's --data flags (or its --config recipe)")

    # -- what the model needs to know, answered right after construction -----------------------
    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = demo_translation_root(self.src_lang, self.tgt_lang)
        return self._root

    def files(self, split: str) -> tuple[Path, Path]:
        return self.root / f"{split}.{self.src_lang}", self.root / f"{split}.{self.tgt_lang}"

    def _existing_files(self, split: str) -> tuple[Path, Path]:
        """``files(split)``, or ``FileNotFoundError`` naming both expected files and the naming rule."""
        src, tgt = self.files(split)
        missing = [f.name for f in (src, tgt) if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{' and '.join(missing)} not found in {self.root}: the {split} split needs {src} and {tgt} "
                f"(files named <split>.<src_lang>/<split>.<tgt_lang>, here <split>.{self.src_lang}/"
                f"<split>.{self.tgt_lang})")
        return src, tgt

    @property
    def tokenizer(self) -> Tokenizer:
        """The joint sentencepiece model of the training split (trained on first use)."""
        if self.predict_path is not None:
            raise RuntimeError("a predict-only datamodule (predict_path given) has no tokenizer: "
                               "predict tokenizes with the tokenizer stored in the checkpoint")
        if self._tokenizer is None and self.streamed is not None:
            self._tokenizer = Tokenizer.from_serialized(base64.b64decode(self.streamed.data["tokenizer"]))
        if self._tokenizer is None:
            files = self._existing_files(self.splits["fit"])
            hp = self.hparams
            self._tokenizer = joint_tokenizer(files, hp.vocab_size, hp.spm_model_type, hp.character_coverage,
                                              name=f"spm.{self.src_lang}-{self.tgt_lang}")
        return self._tokenizer

    @property
    def vocab_size(self) -> int | None:
        """Pieces in the data's vocabulary (``None`` for a predict-only datamodule)."""
        return None if self.predict_path is not None else self.tokenizer.vocab_size

    @property
    def vocabulary_fingerprint(self) -> str | None:
        """:attr:`Tokenizer.fingerprint` of the data's vocabulary, to compare with a checkpoint's
        (``None`` for a predict-only datamodule)."""
        return None if self.predict_path is not None else self.tokenizer.fingerprint

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    # -- splits ----------------------------------------------------------------------------------
    def prepared(self, split: str) -> tuple[PreparedIndex, str]:
        """The split's prepared index (tokenized once, then mapped) and the name warnings give it."""
        if self.streamed is not None:
            return self._streamed_index(split), self.streamed.url(split)
        src_file, tgt_file = self._existing_files(split)
        index = prepare_split(src_file, tgt_file, self.tokenizer, split, self.hparams.prepared_dir)
        return index, str(src_file.with_suffix(""))

    def dataset(self, split: str, training: bool = False) -> ParallelText:
        if split not in self.datasets:
            index, name = self.prepared(split)
            self.datasets[split] = ParallelText(index, self.max_positions, training=training, name=name)
        return self.datasets[split]

    def _streamed_index(self, split: str) -> PreparedIndex:
        """The split's prepared index stored beside its LitData samples, mapped in place from a folder
        or copied once from an object store into the local prepared cache."""
        from datamodules.streaming import fetch_prepared, split_key

        url = self.streamed.url(split)  # a split the dataset lacks is named here
        entry = self.streamed.manifest["splits"][split_key(split)]
        if "tokens" not in entry:
            raise ValueError(f"data.streaming_root={self.streamed.root} was optimized before splits carried their "
                             "token arrays: convert it again with python -m datamodules.optimize --task translate")
        index = fetch_prepared(self.streamed.root, entry["tokens"], self.hparams.prepared_dir)
        if index.meta["tokenizer"] != self.tokenizer.fingerprint:
            raise ValueError(f"{url}: its token arrays were made with vocabulary {index.meta['tokenizer']}, not "
                             f"the dataset's {self.tokenizer.fingerprint}: convert it again")
        return index

    # -- what python -m datamodules.optimize writes -----------------------------------------------------
    def streaming_sources(self, splits: Sequence[str] | None = None) -> dict[str, StoredPairs]:
        """The splits to convert (default: train, valid and test), each with ``stored_sample`` and
        ``store_beside`` (the prepared index a streamed training reads)."""
        names = splits or [name for name in self.splits.values() if all(f.is_file() for f in self.files(name))]
        return {name: StoredPairs(self.prepared(name)[0]) for name in names}

    def streaming_info(self) -> dict:
        """The language pair, the sentencepiece model trained on the training split (base64) and the
        settings it was trained with."""
        return {"src_lang": self.src_lang, "tgt_lang": self.tgt_lang, **self._vocabulary_settings(),
                "tokenizer": base64.b64encode(self.tokenizer.serialized()).decode("ascii")}

    def _vocabulary_settings(self) -> dict:
        hp = self.hparams
        return {"vocab_size": hp.vocab_size, "spm_model_type": hp.spm_model_type,
                "character_coverage": hp.character_coverage}

    def setup(self, stage: str) -> None:
        if stage != "predict" and self.predict_path is not None:
            raise ValueError(f"predict_path is for predict only; drop --data.predict_path to {stage}")
        if stage == "fit":
            self.dataset(self.splits["fit"], training=True)
            self.dataset(self.splits["validate"])
        elif stage in ("validate", "test"):
            self.dataset(self.splits[stage])

    def _replicas(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _loader(self, data: ParallelText, shuffle: bool, max_tokens: int) -> DataLoader:
        replicas, rank = self._replicas()
        sampler = TokenBatchSampler(data.num_tokens, max_tokens, shuffle=shuffle, seed=self.seed,
                                    num_replicas=replicas, rank=rank)
        loader_class = TokenBatchLoader if shuffle else DataLoader
        # a private generator: creating the iterator must not consume the global RNG (exact resume)
        workers = loader_workers(self.num_workers)
        return loader_class(data, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                            persistent_workers=workers > 0, generator=torch.Generator().manual_seed(self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.dataset(self.splits["fit"], training=True), True, self.max_tokens)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.dataset(self.splits["validate"]), False, self.eval_max_tokens)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.dataset(self.splits["test"]), False, self.eval_max_tokens)

    # -- predict: raw text, no dataset -----------------------------------------------------------
    def predict_lines(self) -> list[str]:
        """The lines of ``predict_path`` (read once; ``-`` is standard input)."""
        if self.predict_path is None:
            raise ValueError("predict needs --data.predict_path FILE (or - for standard input)")
        if self._predict_lines is None:
            if self.predict_path == "-":
                # bytes, so a non-UTF-8 line is reported like one in a file, whatever the locale
                self._predict_lines = decode_lines(sys.stdin.buffer.read(), "<standard input>")
            else:
                path = Path(self.predict_path)
                if not path.is_file():
                    raise FileNotFoundError(f"predict_path {path} not found (or not a file)")
                self._predict_lines = read_lines(path)
            if not self._predict_lines:  # otherwise Lightning's generic "length of DataLoader is zero"
                where = "standard input" if self.predict_path == "-" else self.predict_path
                raise ValueError(f"{where} is empty: predict has no sentences to translate")
        return self._predict_lines

    def predict_dataloader(self) -> DataLoader:
        """Batches ``{"index": (B,) long line numbers, "src_text": B raw lines}`` in file order,
        ``predict_batch_size`` lines each (the last may be shorter). Every rank translates every
        line (the task keeps one translation per line). No worker processes: the batches are
        strings already, workers would only add start-up time."""
        lines = list(enumerate(self.predict_lines()))
        return DataLoader(lines, batch_size=self.predict_batch_size, shuffle=False, collate_fn=collate_text)
