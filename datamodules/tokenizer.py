"""A joint source/target sentencepiece model, trained once on the training split.

The model file is cached beside the data (``root/spm.<type><size>.<src>-<tgt>.model``)
or, when ``root`` is read-only, in the suite's data cache under a name derived from
the training files' path, size and modification time. Training runs under a file
lock and lands atomically, so DDP ranks started together train it once.

Special ids are fixed for every model the suite trains: pad 0, unk 1, bos 2, eos 3.
"""
from __future__ import annotations

import fcntl
import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm

from datamodules.demo import cache_home

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Thin wrapper over a ``SentencePieceProcessor``: text <-> ids, no special tokens added."""

    pad_id, unk_id, bos_id, eos_id = PAD_ID, UNK_ID, BOS_ID, EOS_ID

    def __init__(self, model_file: str | os.PathLike):
        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(f"{model_file}: special ids must be pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Detokenize; pad/bos/eos are dropped and decoding stops at the first eos."""
        out = []
        for seq in ids:
            seq = [int(i) for i in seq]
            if EOS_ID in seq:
                seq = seq[: seq.index(EOS_ID)]
            out.append(self.sp.decode([i for i in seq if i not in (PAD_ID, BOS_ID)]))
        return out

    def __getstate__(self):  # picklable for DataLoader workers
        return {"model_file": self.model_file}

    def __setstate__(self, state):
        self.__init__(state["model_file"])


def train_sentencepiece(
    files: Iterable[Path],
    model_file: Path,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    input_sentence_size: int = 2_000_000,
) -> Path:
    """Train a joint model on the lines of ``files`` and write it to ``model_file`` atomically.

    ``vocab_size`` is an upper bound (a small corpus may not support it; the model then
    gets as many pieces as the data allow instead of failing).
    """
    files = [str(f) for f in files]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=files,
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
    fd, tmp = tempfile.mkstemp(dir=model_file.parent, prefix=f".{model_file.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(tmp, model_file)
    return model_file


def joint_tokenizer(
    train_files: Sequence[Path],
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    name: str = "spm",
) -> Tokenizer:
    """Load the joint model for ``train_files``, training it on first use."""
    train_files = [Path(f) for f in train_files]
    stem = f"{name}.{model_type}{vocab_size}"
    beside = train_files[0].parent / f"{stem}.model"
    if beside.is_file():
        return Tokenizer(beside)
    if os.access(beside.parent, os.W_OK):
        target = beside
    else:
        # read-only dataset: key the cached model on what it was trained from
        h = hashlib.sha1()
        for f in train_files:
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        target = cache_home() / "tokenizers" / f"{stem}.{h.hexdigest()[:16]}.model"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other ranks wait while one trains
            if not target.is_file():
                train_sentencepiece(train_files, target, vocab_size, model_type, character_coverage)
    return Tokenizer(target)
