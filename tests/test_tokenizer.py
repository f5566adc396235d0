"""The joint sentencepiece tokenizer: carried as bytes (checkpoints, DataLoader workers),
identified by a fingerprint, and retrained when the data it was cached for changes."""
import json
import logging
import os
import pickle
import random
from pathlib import Path

import pytest

from datamodules.tokenizer import (BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, data_fingerprint, joint_tokenizer,
                                   record_file)

LATIN = ["north", "south", "river", "mountain", "valley", "island", "kingdom", "republic", "province", "city",
         "lake", "coast", "desert", "forest", "bridge", "harbour", "market", "castle", "village", "tower"]
GERMAN = ["Nord", "Süd", "Fluss", "Berg", "Tal", "Insel", "Königreich", "Republik", "Provinz", "Stadt",
          "See", "Küste", "Wüste", "Wald", "Brücke", "Hafen", "Markt", "Burg", "Dorf", "Turm"]
# a second corpus in scripts the first one never uses: a stale model turns all of it into ⁇
GREEK = ["βορράς", "νότος", "ποταμός", "βουνό", "κοιλάδα", "νησί", "βασίλειο", "δημοκρατία", "επαρχία", "πόλη"]
RUSSIAN = ["север", "юг", "река", "гора", "долина", "остров", "королевство", "республика", "провинция", "город"]


def write_corpus(root: Path, src_words: list[str], tgt_words: list[str], lines: int = 300, seed: int = 0):
    """``root/train.en`` and ``root/train.de``: ``lines`` sentences of 2-6 words each."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    src, tgt = [], []
    for _ in range(lines):
        picks = [rng.randrange(len(src_words)) for _ in range(rng.randint(2, 6))]
        src.append(" ".join(src_words[i] for i in picks))
        tgt.append(" ".join(tgt_words[i] for i in picks))
    (root / "train.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (root / "train.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")
    return [root / "train.en", root / "train.de"]


@pytest.fixture
def files(tmp_path):
    return write_corpus(tmp_path / "data", LATIN, GERMAN)


def test_serialized_model_rebuilds_the_same_tokenizer_and_fingerprint(files):
    tok = joint_tokenizer(files, 200, name="spm.en-de")
    data = tok.serialized()
    assert isinstance(data, bytes) and data == tok.sp.serialized_model_proto()
    again = Tokenizer.from_serialized(data)
    assert again.model_file is None
    assert again.fingerprint == tok.fingerprint and len(tok.fingerprint) == 16
    assert again.vocab_size == tok.vocab_size
    assert (again.pad_id, again.unk_id, again.bos_id, again.eos_id) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    text = ["north river castle", "Königreich Brücke Turm"]
    assert again.encode(text) == tok.encode(text)
    assert again.decode(tok.encode(text)) == text
    # another vocabulary, another fingerprint
    other = joint_tokenizer(write_corpus(files[0].parent.parent / "other", GREEK, RUSSIAN), 200, name="spm.en-de")
    assert other.fingerprint != tok.fingerprint


def test_both_kinds_pickle_and_carry_their_model_not_the_file(files):
    tok = joint_tokenizer(files, 200, name="spm.en-de")
    text = ["south valley", "Wald Hafen Markt"]
    for original in (tok, Tokenizer.from_serialized(tok.serialized())):
        copy = pickle.loads(pickle.dumps(original))
        assert copy.model_file == original.model_file
        assert copy.fingerprint == original.fingerprint and copy.encode(text) == original.encode(text)
    # a worker unpickling after the model file was replaced still gets the vocabulary in use
    state = pickle.dumps(tok)
    tok.model_file.write_bytes(b"not a model any more")
    assert pickle.loads(state).fingerprint == tok.fingerprint


def test_a_serialized_model_must_be_sentencepiece_with_the_suites_special_ids(files, tmp_path):
    import io

    import sentencepiece as spm

    with pytest.raises(ValueError, match="not a serialized sentencepiece model"):
        Tokenizer.from_serialized(b"garbage")
    buffer = io.BytesIO()  # sentencepiece's default ids: unk 0, bos 1, eos 2, no pad
    spm.SentencePieceTrainer.train(input=[str(f) for f in files], model_writer=buffer, vocab_size=100,
                                   hard_vocab_limit=False, minloglevel=2)
    with pytest.raises(ValueError, match="special ids must be pad=0 unk=1 bos=2 eos=3"):
        Tokenizer.from_serialized(buffer.getvalue())


def test_replaced_training_files_retrain_the_cached_model(files, caplog):
    old = joint_tokenizer(files, 200, name="spm.en-de")
    model, record = old.model_file, record_file(old.model_file)
    assert json.loads(record.read_text())["data_sha256"] == data_fingerprint(files)
    new_words = ["βορράς ποταμός πόλη", "север река город"]
    assert "⁇" in " ".join(old.decode(old.encode(new_words)))  # the premise: the old model cannot spell them

    write_corpus(files[0].parent, GREEK, RUSSIAN)
    with caplog.at_level(logging.INFO, logger="datamodules.tokenizer"):
        new = joint_tokenizer(files, 200, name="spm.en-de")
    assert new.model_file == model  # same place, new content
    assert new.fingerprint != old.fingerprint
    assert new.decode(new.encode(new_words)) == new_words
    assert f"retraining the sentencepiece model {model}: the training files changed" in caplog.text
    assert json.loads(record.read_text())["data_sha256"] == data_fingerprint(files)


def test_unchanged_content_reuses_the_model_even_when_touched(files):
    tok = joint_tokenizer(files, 200, name="spm.en-de")
    mtime = tok.model_file.stat().st_mtime_ns
    for f in files:  # a copy or a touch changes mtimes, not the text
        os.utime(f, ns=(0, 0))
    again = joint_tokenizer(files, 200, name="spm.en-de")
    assert again.model_file.stat().st_mtime_ns == mtime and again.fingerprint == tok.fingerprint


def test_other_settings_or_a_missing_record_retrain(files, caplog):
    tok = joint_tokenizer(files, 200, name="spm.en-de")
    with caplog.at_level(logging.WARNING, logger="datamodules.tokenizer"):
        joint_tokenizer(files, 200, character_coverage=0.9999, name="spm.en-de")
    assert "the training settings changed (character_coverage=1.0 -> 0.9999)" in caplog.text
    assert json.loads(record_file(tok.model_file).read_text())["character_coverage"] == 0.9999
    caplog.clear()
    # a model cached before records existed cannot say what it was trained from
    record_file(tok.model_file).unlink()
    with caplog.at_level(logging.WARNING, logger="datamodules.tokenizer"):
        joint_tokenizer(files, 200, name="spm.en-de")
    assert "spm.en-de.unigram200.model.json (the record of the data it was trained from) is missing" in caplog.text
    assert record_file(tok.model_file).is_file()


def test_read_only_root_with_a_stale_model_trains_a_fresh_one_in_the_cache(files, monkeypatch):
    root = files[0].parent
    old = joint_tokenizer(files, 200, name="spm.en-de")
    write_corpus(root, GREEK, RUSSIAN)
    import datamodules.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module.os, "access", lambda path, mode: Path(path) != root)
    before = old.model_file.read_bytes()
    new = joint_tokenizer(files, 200, name="spm.en-de")
    assert root not in new.model_file.parents and data_fingerprint(files)[:16] in new.model_file.name
    assert old.model_file.read_bytes() == before  # the read-only root is left alone
    assert new.decode(new.encode(["νησί βουνό"])) == ["νησί βουνό"]


def test_an_empty_training_file_is_refused_by_name(files):
    files[1].write_bytes(b"")
    with pytest.raises(ValueError, match=r"train\.de is empty: it has no sentences"):
        joint_tokenizer(files, 200, name="spm.en-de")


def test_the_content_hash_is_remembered_until_a_file_changes_in_any_way(files, monkeypatch):
    """Later starts stat the training files instead of hashing them; a file rewritten with its size and
    modification time kept (``cp -p``) has a new ctime and is hashed again."""
    import time

    import datamodules.tokenizer as tokenizer_module
    from datamodules.tokenizer import remembered_data_fingerprint

    monkeypatch.setattr(tokenizer_module, "RACY_SECONDS", -60.0)  # files written just now count as settled
    first = remembered_data_fingerprint(files)
    assert first == data_fingerprint(files)

    def no_hashing(files):
        raise AssertionError("the files were hashed again")

    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_module, "data_fingerprint", no_hashing)
        assert remembered_data_fingerprint(files) == first
    time.sleep(0.05)  # past the filesystem's timestamp tick
    stat = files[1].stat()
    text = files[1].read_bytes()
    files[1].write_bytes(text[::-1])  # same size, other content, then the old mtime back
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files[1].stat().st_mtime_ns == stat.st_mtime_ns and files[1].stat().st_size == stat.st_size
    assert remembered_data_fingerprint(files) == data_fingerprint(files) != first
