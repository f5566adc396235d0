"""Translation data: the demo corpus, the sentencepiece model, reading the WMT layout
(and refusing bad files), token-based batching and its sharding over ranks."""
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.demo_text import SPLITS, parallel_pairs, write_corpus
from datamodules.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, joint_tokenizer
from datamodules.wmt import TokenBatchSampler, TranslationDataModule, pack_by_tokens, read_lines


def read_split(root: Path, split: str, lang: str) -> list[str]:
    return (root / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="module")
def demo():
    dm = TranslationDataModule(vocab_size=1000, max_tokens=256)
    return dm


def test_demo_corpus_is_thousands_of_distinct_real_pairs_in_three_disjoint_splits(demo):
    root = demo.root
    sizes = {}
    sources = {}
    for split in SPLITS:
        en, de = read_split(root, split, "en"), read_split(root, split, "de")
        assert len(en) == len(de)
        assert all(s and t and s != t for s, t in zip(en, de))
        sizes[split] = len(en)
        sources[split] = set(en)
        assert len(sources[split]) == len(en)  # deduplicated
    assert sum(sizes.values()) > 5000 and min(sizes["valid"], sizes["test"]) > 200
    assert not (sources["train"] & sources["test"]) and not (sources["train"] & sources["valid"])
    pairs = dict(zip(read_split(root, "train", "en") + read_split(root, "test", "en"),
                     read_split(root, "train", "de") + read_split(root, "test", "de")))
    assert pairs["Germany"] == "Deutschland"  # CLDR / ISO 3166 human translations
    assert pairs.get("Switzerland", "Schweiz") == "Schweiz"


def test_demo_corpus_is_deterministic_and_other_pairs_exist(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_corpus(a, "en", "fr")
    write_corpus(b, "en", "fr")
    for split in SPLITS:
        for lang in ("en", "fr"):
            assert (a / f"{split}.{lang}").read_bytes() == (b / f"{split}.{lang}").read_bytes()
    assert dict(parallel_pairs("en", "fr"))["Germany"] == "Allemagne"
    with pytest.raises(ValueError, match="both"):
        parallel_pairs("de", "de")


def test_joint_sentencepiece_is_trained_once_beside_the_data_and_round_trips(demo):
    tok = demo.tokenizer
    model = tok.model_file
    assert model.parent == demo.root and model.suffix == ".model"
    mtime = model.stat().st_mtime_ns
    again = joint_tokenizer(demo.files("train"), 1000, name="spm.en-de")
    assert again.model_file == model and model.stat().st_mtime_ns == mtime
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    text = ["Vereinigte Arabische Emirate", "7 kilometers per hour"]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # decoding stops at eos and drops bos/pad
    assert tok.decode([[BOS_ID] + ids[0] + [EOS_ID] + ids[1] + [PAD_ID]]) == text[:1]
    assert tok.vocab_size == demo.vocab_size <= 1000


def test_read_only_root_caches_the_tokenizer_elsewhere(demo, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    for lang in ("en", "de"):
        (ro / f"train.{lang}").write_bytes((demo.root / f"train.{lang}").read_bytes())
    import datamodules.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module.os, "access", lambda path, mode: Path(path) != ro)
    tok = joint_tokenizer([ro / "train.en", ro / "train.de"], 500, name="spm.en-de")
    assert ro not in tok.model_file.parents and tok.model_file.is_file()
    assert list(ro.iterdir()) and not list(ro.glob("*.model"))


def write_pair(root: Path, split: str, src: list[str], tgt: list[str]):
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{split}.en").write_text("".join(s + "\n" for s in src), encoding="utf-8")
    (root / f"{split}.de").write_text("".join(t + "\n" for t in tgt), encoding="utf-8")


def small_root(tmp_path: Path, demo) -> Path:
    root = tmp_path / "wmt"
    for split in SPLITS:
        en, de = read_split(demo.root, split, "en")[:300], read_split(demo.root, split, "de")[:300]
        write_pair(root, split, en, de)
    return root


def test_different_line_counts_name_both_files_and_counts(tmp_path, demo):
    root = small_root(tmp_path, demo)
    (root / "valid.de").write_text("eins\nzwei\n", encoding="utf-8")
    dm = TranslationDataModule(root=str(root), vocab_size=300)
    with pytest.raises(ValueError) as err:
        dm.setup("validate")
    msg = str(err.value)
    assert "valid.en" in msg and "300 lines" in msg and "valid.de" in msg and "2 lines" in msg


def test_non_utf8_names_the_file_and_line(tmp_path):
    bad = tmp_path / "train.de"
    bad.write_bytes("eins\nzwei\n".encode() + b"dr\xe9i\n")
    with pytest.raises(ValueError, match=r"train\.de: line 3 is not valid UTF-8"):
        read_lines(bad)


def test_empty_and_overlong_training_pairs_are_dropped_and_counted(tmp_path, demo, caplog):
    root = small_root(tmp_path, demo)
    en, de = read_split(root, "train", "en"), read_split(root, "train", "de")
    en[3], de[5], en[7] = "", "  ", " ".join(["Germany"] * 40)
    write_pair(root, "train", en, de)
    dm = TranslationDataModule(root=str(root), vocab_size=300, max_positions=24)
    encode = dm.tokenizer.encode
    long = {i for i, (s, t) in enumerate(zip(encode(en), encode(de))) if max(len(s), len(t)) > 23}
    assert 7 in long and len(long) < 50
    with caplog.at_level(logging.WARNING, logger="datamodules.wmt"):
        dm.setup("fit")
    train = dm.datasets["train"]
    dropped = {3, 5} | long
    assert set(train.index.tolist()) == set(range(300)) - dropped
    assert f"dropped {len(dropped)} of 300 pairs (2 empty, {len(long)} longer than 23 tokens)" in caplog.text
    assert max(train.num_tokens) <= 24
    # evaluation keeps every line (hypotheses stay aligned with the source file); long sources are cut
    assert len(dm.datasets["valid"]) == 300


def test_batches_respect_max_tokens_and_the_decoder_shift(demo):
    demo.setup("fit")
    loader = demo.train_dataloader()
    seen = []
    for batch in loader:
        b, s = batch["src"].shape
        assert b * max(s, batch["tgt_in"].shape[1]) <= 256
        assert torch.equal(batch["tgt_in"][:, 0], torch.full((b,), BOS_ID))
        lengths = batch["tgt_out"].ne(PAD_ID).sum(1)
        assert batch["tgt_out"][torch.arange(b), lengths - 1].eq(EOS_ID).all()
        # teacher forcing: the decoder input is the target shifted right by one
        inner = batch["tgt_out"][:, :-1].masked_fill(batch["tgt_out"][:, :-1] == EOS_ID, PAD_ID)
        assert torch.equal(batch["tgt_in"][:, 1:], inner)
        seen += batch["index"].tolist()
    assert sorted(seen) == demo.datasets["train"].index.tolist()  # every pair once per epoch


def test_pack_by_tokens_counts_padded_tokens():
    num_tokens = np.array([3, 3, 4, 10, 2])
    batches = pack_by_tokens(np.arange(5), num_tokens, max_tokens=10)
    assert [b.tolist() for b in batches] == [[0, 1], [2], [3], [4]]


def test_training_batches_are_deterministic_per_epoch_and_disjoint_over_ranks():
    rng = np.random.default_rng(0)
    num_tokens = rng.integers(1, 30, size=500)

    def epoch_batches(epoch, rank=0, replicas=1):
        sampler = TokenBatchSampler(num_tokens, 120, shuffle=True, seed=7, num_replicas=replicas, rank=rank)
        sampler.set_epoch(epoch)
        return [tuple(b) for b in sampler]

    assert epoch_batches(0) == epoch_batches(0)
    assert epoch_batches(0) != epoch_batches(1)
    ranks = [epoch_batches(3, r, 3) for r in range(3)]
    assert len({len(r) for r in ranks}) == 1  # same number of steps on every rank
    flat = [i for r in ranks for b in r for i in b]
    assert len(flat) == len(set(flat))
    for batch in ranks[0]:
        assert len(batch) * num_tokens[list(batch)].max() <= 120


def test_evaluation_shards_cover_every_sentence_exactly_once():
    num_tokens = np.random.default_rng(1).integers(1, 30, size=101)
    seen = []
    for rank in range(4):
        seen += [i for b in TokenBatchSampler(num_tokens, 100, shuffle=False, num_replicas=4, rank=rank) for i in b]
    assert sorted(seen) == list(range(101))


def test_vocabulary_comes_from_the_data_right_after_construction(tmp_path, demo):
    dm = TranslationDataModule(root=str(small_root(tmp_path, demo)), vocab_size=300)
    assert dm.vocab_size <= 300 and (dm.pad_id, dm.bos_id, dm.eos_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert (dm.root / "spm.en-de.unigram300.model").is_file()


def test_the_vocabulary_fingerprint_is_the_tokenizers(demo):
    from datamodules.tokenizer import Tokenizer

    assert demo.vocabulary_fingerprint == demo.tokenizer.fingerprint
    assert Tokenizer.from_serialized(demo.tokenizer.serialized()).fingerprint == demo.vocabulary_fingerprint


# -- refusing bad layouts with the exact file names -----------------------------------------------
def test_missing_files_name_the_expected_file_names(tmp_path, demo):
    root = small_root(tmp_path, demo)
    (root / "test.de").unlink()
    dm = TranslationDataModule(root=str(root), vocab_size=300)
    with pytest.raises(FileNotFoundError) as err:
        dm.setup("test")
    msg = str(err.value)
    assert f"{root / 'test.en'} and {root / 'test.de'}" in msg
    assert "files named <split>.<src_lang>/<split>.<tgt_lang>" in msg and msg.startswith("test.de not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"train\.en and train\.de not found in {empty}: .*"
                                                rf"{empty / 'train.en'} and {empty / 'train.de'}"):
        TranslationDataModule(root=str(empty)).vocab_size


@pytest.mark.parametrize("split", ["valid", "test"])
def test_empty_evaluation_files_name_the_files(tmp_path, demo, split):
    root = small_root(tmp_path, demo)
    write_pair(root, split, [], [])
    dm = TranslationDataModule(root=str(root), vocab_size=300)
    stage = "validate" if split == "valid" else "test"
    with pytest.raises(ValueError, match=rf"{split}\.en and .*{split}\.de are empty: the {split} split has no "
                                         "sentences"):
        dm.setup(stage)
    if split == "valid":  # fit reads the validation split too
        with pytest.raises(ValueError, match="valid split has no sentences"):
            TranslationDataModule(root=str(root), vocab_size=300).setup("fit")


def test_an_empty_training_file_names_the_file(tmp_path, demo):
    root = small_root(tmp_path, demo)
    (root / "train.en").write_bytes(b"")
    with pytest.raises(ValueError, match=r"train\.en is empty: it has no sentences"):
        TranslationDataModule(root=str(root), vocab_size=300).vocab_size


def test_a_training_split_with_no_usable_pair_is_refused(tmp_path, demo):
    root = small_root(tmp_path, demo)
    dm = TranslationDataModule(root=str(root), vocab_size=300)
    dm.tokenizer  # trained on the real text, then the training pairs become blank
    write_pair(root, "train", ["", " "], ["eins", "zwei"])
    with pytest.raises(ValueError, match=r"none of the 2 pairs can be trained on \(2 empty"):
        dm.setup("fit")


# -- predict: raw text from predict_path alone ---------------------------------------------------
@pytest.fixture
def no_data(monkeypatch):
    """Fail the test if anything builds the demo corpus or loads/trains a tokenizer."""
    import datamodules.wmt as wmt

    def forbidden(*args, **kwargs):
        raise AssertionError("predict touched the dataset or the tokenizer")

    monkeypatch.setattr(wmt, "demo_translation_root", forbidden)
    monkeypatch.setattr(wmt, "joint_tokenizer", forbidden)


def test_predict_batches_are_raw_text_in_file_order_without_any_dataset(tmp_path, no_data):
    lines = [f"sentence {i}" for i in range(7)] + ["", "Vereinigte Arabische Emirate"]
    src = tmp_path / "in.en"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    for root in (None, str(tmp_path / "does-not-exist")):
        dm = TranslationDataModule(root=root, predict_path=str(src), predict_batch_size=4)
        assert dm.vocab_size is None and dm.vocabulary_fingerprint is None
        dm.setup("predict")
        batches = list(dm.predict_dataloader())
        assert [len(b["src_text"]) for b in batches] == [4, 4, 1]
        for b in batches:
            assert set(b) == {"index", "src_text"}
            assert b["index"].dtype == torch.long and b["index"].shape == (len(b["src_text"]),)
        assert [i for b in batches for i in b["index"].tolist()] == list(range(len(lines)))
        assert [s for b in batches for s in b["src_text"]] == lines
        assert dm._root == (None if root is None else Path(root))
    with pytest.raises(RuntimeError, match="checkpoint"):
        dm.tokenizer
    with pytest.raises(ValueError, match="predict_path is for predict only"):
        dm.setup("fit")


def test_predict_reads_standard_input_once(monkeypatch, no_data):
    import io
    import sys

    stdin = io.TextIOWrapper(io.BytesIO("Germany\r\n\n7 kilometers per hour\n".encode()), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    dm = TranslationDataModule(predict_path="-", predict_batch_size=2)
    first = [s for b in dm.predict_dataloader() for s in b["src_text"]]
    assert first == ["Germany", "", "7 kilometers per hour"]
    assert [s for b in dm.predict_dataloader() for s in b["src_text"]] == first


def test_predict_refuses_missing_empty_and_non_utf8_input(tmp_path, monkeypatch, no_data):
    import io
    import sys

    missing = tmp_path / "nope.en"
    with pytest.raises(FileNotFoundError, match=f"predict_path {missing} not found"):
        TranslationDataModule(predict_path=str(missing)).predict_dataloader()
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"eins\nzwei\ndr\xe9i\n")
    with pytest.raises(ValueError, match=r"bad\.en: line 3 is not valid UTF-8"):
        TranslationDataModule(predict_path=str(bad)).predict_dataloader()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    with pytest.raises(ValueError, match="<standard input>: line 2 is not valid UTF-8"):
        TranslationDataModule(predict_path="-").predict_dataloader()
    empty = tmp_path / "empty.en"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.en is empty: predict has no sentences"):
        TranslationDataModule(predict_path=str(empty)).predict_dataloader()
    with pytest.raises(ValueError, match="predict needs --data.predict_path"):
        TranslationDataModule(root=str(tmp_path)).predict_dataloader()


@pytest.mark.parametrize("split, stage", [("test", "test"), ("valid", "validate")])
def test_blank_evaluation_lines_are_scored_as_they_are_and_named(tmp_path, demo, caplog, split, stage):
    """A whitespace-only reference is not dropped (that would change the test set) but reported."""
    root = small_root(tmp_path, demo)
    en, de = read_split(root, split, "en"), read_split(root, split, "de")
    de[6], en[40], de[40] = "   ", "", "\t"
    write_pair(root, split, en, de)
    dm = TranslationDataModule(root=str(root), vocab_size=300)
    with caplog.at_level(logging.WARNING, logger="datamodules.wmt"):
        dm.setup(stage)
    assert len(dm.datasets[split]) == 300  # every line is still scored, in file order
    assert (f"{root / split}: 2 of 300 pairs have an empty side (2 empty references, 1 empty sources; line 7, 41); "
            "they are scored as they are") in caplog.text
