"""The prepared WMT index: each split tokenized once into flat arrays that every start, rank and
worker maps; batches equal to encoding the text directly; text hygiene (byte order marks, CRLF and
old-Mac line breaks) in every text the translation data reads."""
import logging
import os

import numpy as np
import pytest
import sacrebleu
import torch
from lightning.pytorch import Trainer

import datamodules.wmt as wmt
from datamodules.demo_text import SPLITS
from datamodules.tokenizer import EOS_ID, decode_lines, read_lines
from datamodules.wmt import TranslationDataModule, collate
from tasks.translate import TranslationTask
from tests.test_wmt_data import read_split, small_root, write_pair

SETTINGS = dict(vocab_size=300, max_tokens=256, eval_max_tokens=512)


@pytest.fixture(scope="module")
def demo():
    return TranslationDataModule(vocab_size=1000)


def direct_items(dm: TranslationDataModule, split: str, training: bool) -> dict[int, tuple]:
    """``{line: item}`` as the dataset must give them, from the text files encoded here line by line
    (the rules of the datamodule written out again: empty or long training pairs dropped, long
    evaluation sources cut)."""
    src, tgt = read_lines(dm.files(split)[0]), read_lines(dm.files(split)[1])
    encode, limit = dm.tokenizer.encode, dm.max_positions - 1
    items = {}
    for line, (s, t, s_ids, t_ids) in enumerate(zip(src, tgt, encode(src), encode(tgt))):
        if training and (not s.strip() or not t.strip() or len(s_ids) > limit or len(t_ids) > limit):
            continue
        items[line] = (line, np.array(s_ids[:limit] + [EOS_ID]), np.array(t_ids[:limit]), s, t)
    return items


def assert_same_batch(batch: dict, expected: dict) -> None:
    assert batch.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert batch[key].dtype == value.dtype and torch.equal(batch[key], value), key
        else:
            assert batch[key] == value, key


@pytest.mark.parametrize("split", ["train", "valid"])
def test_prepared_batches_equal_the_batches_of_the_directly_encoded_text(tmp_path, demo, split):
    root = small_root(tmp_path, demo)
    en, de = read_split(root, "train", "en"), read_split(root, "train", "de")
    en[3], de[5], en[7] = "", " ", " ".join(["Germany"] * 40)  # dropped from training, kept and cut in valid
    write_pair(root, "train", en, de)
    write_pair(root, "valid", en, de)
    dm = TranslationDataModule(root=str(root), max_positions=24, prepared_dir=str(tmp_path / "prepared"), **SETTINGS)
    dm.setup("fit")
    training = split == "train"
    expected = direct_items(dm, split, training)
    data = dm.datasets[split]
    assert data.index.tolist() == sorted(expected)
    loader = dm.train_dataloader() if training else dm.val_dataloader()
    seen = 0
    for indices, batch in zip(loader.batch_sampler, loader):
        assert_same_batch(batch, collate([expected[int(data.index[i])] for i in indices]))
        seen += len(indices)
    assert seen == len(expected) and (training or seen == 300)


def test_a_split_is_tokenized_once_and_filtered_at_load(tmp_path, demo, monkeypatch, caplog):
    root = small_root(tmp_path, demo)
    prepared = tmp_path / "prepared"
    dm = TranslationDataModule(root=str(root), prepared_dir=str(prepared), **SETTINGS)
    dm.setup("fit")
    index, _ = dm.prepared("train")
    assert prepared in index.folder.parents  # the cache is prepared_dir, the dataset folder untouched
    assert all(isinstance(index[name], np.memmap) for name in index)
    assert index["tokens"].dtype == np.uint16 and len(index["src_offsets"]) == 301
    assert index.meta["tokenizer"] == dm.tokenizer.fingerprint

    def no_build(*args, **kwargs):
        raise AssertionError("the prepared index was built again")

    monkeypatch.setattr(wmt, "build_index", no_build)
    for max_positions in (256, 12):  # another max_positions filters the same arrays
        other = TranslationDataModule(root=str(root), prepared_dir=str(prepared), max_positions=max_positions,
                                      **SETTINGS)
        other.setup("fit")
        assert other.datasets["train"].num_tokens.max() <= max_positions
    monkeypatch.undo()
    # a rewritten file, same text and modification time (cp -p): its ctime changed, the index is rebuilt
    stat = (root / "valid.de").stat()
    (root / "valid.de").write_bytes((root / "valid.de").read_bytes())
    os.utime(root / "valid.de", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="datamodules.prepared"):
        TranslationDataModule(root=str(root), prepared_dir=str(prepared), **SETTINGS).prepared("valid")
    assert "changed since its wmt index was prepared" in caplog.text and "tgt" in caplog.text


# -- text hygiene --------------------------------------------------------------------------------------------
def test_byte_order_marks_and_every_line_break_read_as_plain_lines(tmp_path):
    lines = ["Germany", "", "  7 kilometers per hour ", "Café-Liebhaber"]
    for name, data in {"crlf": "\r\n".join(lines) + "\r\n", "cr": "\r".join(lines) + "\r",
                       "bom-lf": "\ufeff" + "\n".join(lines), "bom-cr": "\ufeff" + "\r".join(lines)}.items():
        path = tmp_path / name
        path.write_bytes(data.encode("utf-8"))
        assert read_lines(path) == lines, name
        assert decode_lines(data.encode("utf-8"), name) == lines, name
    # a lone "\r" inside a line of a "\n" file stays in its line: splitting would shift the pairs after it
    assert decode_lines(b"a\rb\nc\n", "x") == ["a\rb", "c"]
    assert decode_lines(b"ok\r\n\xef\xbb\xbfnot a mark here\r\n", "x") == ["ok", "\ufeffnot a mark here"]
    with pytest.raises(ValueError, match=r"x: line 2 is not valid UTF-8"):
        decode_lines(b"\xef\xbb\xbfok\r\xff\r", "x")


def test_bom_and_old_mac_files_give_the_clean_files_data(tmp_path, demo):
    """Every split written with a BOM and CR-only (or CRLF) line breaks: the same tokenizer, pairs and
    references as the clean files, so a perfect translation scores BLEU 100 against a BOM reference."""
    clean = small_root(tmp_path / "clean", demo)
    messy = tmp_path / "messy"
    messy.mkdir()
    for split in SPLITS:
        for lang, newline in (("en", "\r"), ("de", "\r\n")):
            lines = read_split(clean, split, lang)
            (messy / f"{split}.{lang}").write_bytes(("\ufeff" + newline.join(lines) + newline).encode("utf-8"))
    data = {}
    for name, root in (("clean", clean), ("messy", messy)):
        dm = TranslationDataModule(root=str(root), max_positions=128, prepared_dir=str(tmp_path / name), **SETTINGS)
        dm.setup("fit")
        dm.setup("test")
        data[name] = dm
    pieces = {name: [(dm.tokenizer.sp.id_to_piece(i), dm.tokenizer.sp.get_score(i)) for i in range(dm.vocab_size)]
              for name, dm in data.items()}  # (the fingerprints differ: a model records the files it read)
    assert pieces["messy"] == pieces["clean"]
    for split in SPLITS:
        a, b = data["clean"].datasets[split], data["messy"].datasets[split]
        assert a.index.tolist() == b.index.tolist() and len(a) == 300  # nothing dropped as "too long"
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert x[0] == y[0] and np.array_equal(x[1], y[1]) and np.array_equal(x[2], y[2]) and x[3:] == y[3:]
    test = data["messy"].datasets["test"]
    refs = [test[i][4] for i in range(len(test))]
    assert refs[0] == read_split(clean, "test", "de")[0]
    perfect = read_split(clean, "test", "de")
    assert sacrebleu.corpus_bleu(perfect, [refs]).score == pytest.approx(100.0)


def test_predict_input_drops_a_bom_and_reads_cr_line_breaks(tmp_path, monkeypatch):
    import io
    import sys

    path = tmp_path / "in.en"
    path.write_bytes("\ufeffGermany\r\r7 kilometers per hour\r".encode())
    batches = list(TranslationDataModule(predict_path=str(path)).predict_dataloader())
    assert batches[0]["src_text"] == ["Germany", "", "7 kilometers per hour"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffeins\r\nzwei\r\n".encode())))
    assert TranslationDataModule(predict_path="-").predict_lines() == ["eins", "zwei"]


def test_predict_warns_how_many_lines_it_truncates(tmp_path, demo, recwarn):
    """A 5,000-token line (and a second long one) are cut to max_positions - 1 tokens with one warning
    that counts them and names the first line."""
    long = " ".join(["Germany"] * 2500)
    path = tmp_path / "in.en"
    path.write_text(f"Germany\n{long}\nFrance\n{long}\n", encoding="utf-8")
    model = TranslationTask(vocab_size=demo.vocab_size, max_positions=32, dim=16, encoder_depth=1, decoder_depth=1,
                            num_heads=2, ffn_dim=16, beam_size=1, max_len_a=0.0, max_len_b=2,
                            predict_output=str(tmp_path / "out.de"))
    model._tokenizer = demo.tokenizer
    assert len(demo.tokenizer.encode([long])[0]) >= 5000
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      default_root_dir=str(tmp_path))
    trainer.predict(model, datamodule=TranslationDataModule(predict_path=str(path), predict_batch_size=3))
    messages = [str(w.message) for w in recwarn if "truncated" in str(w.message)]
    assert messages == ["predict: 2 of 4 lines had more than 31 tokens and were truncated to 31 tokens (the "
                        "model's max_positions 32, eos included); the first is line 2"]
    assert len((tmp_path / "out.de").read_text(encoding="utf-8").splitlines()) == 4
