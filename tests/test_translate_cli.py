"""The translation CLI end to end, in subprocesses, with a tiny model on the demo corpus."""
import json
from pathlib import Path

import pytest
import sacrebleu
import torch
import yaml

from configs.tasks import is_recipe
from tests.conftest import REPO
from tests.test_bleu_tok_compound import by_hand

TINY = ["--model.dim", "32", "--model.encoder_depth", "1", "--model.decoder_depth", "1", "--model.num_heads", "2",
        "--model.ffn_dim", "64", "--model.max_len_b", "4", "--model.beam_size", "2", "--data.vocab_size", "500",
        "--data.max_tokens", "512", "--data.eval_max_tokens", "4096", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, demo_cache):
    """One short fit shared by the tests below: (run directory, last checkpoint)."""
    from tests.conftest import run_task

    cwd = tmp_path_factory.mktemp("translate-fit")
    proc = run_task("translate", "fit", *TINY, "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1",
                    "--trainer.val_check_interval", "4", cwd=cwd)
    root = cwd / "runs" / "translate"
    last = next(root.rglob("last.ckpt"))
    return cwd, root, last, proc


def run_in(cwd: Path, *args: str, stdin: str | None = None):
    from tests.conftest import run_task

    return run_task("translate", *args, cwd=cwd, input=stdin)


def test_fit_checkpoints_on_bleu_and_logs_the_linked_vocabulary(fitted):
    cwd, root, last, proc = fitted
    assert any(p.name.startswith("best-") for p in root.rglob("*.ckpt"))
    run_dir = next((root / "wandb").glob("offline-run-*"))
    config = yaml.safe_load((run_dir / "files" / "suite_config.yaml").read_text())
    assert config["checkpoint"]["monitor"] == "val/bleu"
    hparams = torch.load(last, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert 0 < hparams["vocab_size"] <= 500  # linked from the sentencepiece model


@pytest.mark.slow  # a second fit; the default logger (wandb) is the one that refused
def test_a_corpus_smaller_than_the_vocabulary_asked_for_trains_with_the_vocabulary_it_fills(tmp_path, demo_cache):
    """``data.vocab_size`` is an upper bound: the model gets the pieces the corpus filled, and the fit logs the
    datamodule's and the model's different ``vocab_size`` (the logger must not refuse the pair)."""
    args = [a if a != "500" else "30000" for a in TINY]
    run_in(tmp_path, "fit", *args, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
           "--trainer.val_check_interval", "2")
    checkpoint = torch.load(next((tmp_path / "runs" / "translate").rglob("last.ckpt")), map_location="cpu",
                            weights_only=False)
    assert checkpoint["datamodule_hyper_parameters"]["vocab_size"] == 30000  # what was asked for
    assert 0 < checkpoint["hyper_parameters"]["vocab_size"] < 30000  # what the demo corpus filled


def test_test_writes_hypotheses_in_source_order_and_the_scores_they_get(fitted, demo_cache):
    cwd, root, last, _ = fitted
    run_in(cwd, "test", *TINY, "--ckpt_path", str(last))
    predictions = root / "predictions"
    hyps = (predictions / "hypotheses.txt").read_text(encoding="utf-8").split("\n")[:-1]
    data = next(demo_cache.glob("translate-en-de-v*"))
    refs = (data / "test.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs)  # one line per source line
    metrics = json.loads((predictions / "metrics.json").read_text())
    assert set(metrics) == {"test/bleu", "test/bleu_tok_compound", "test/chrf", "test/chrf++", "test/loss", "test/ppl",
                            "params", "gflops", "gmacs"}
    # the numbers are sacreBLEU's on exactly these lines, against the raw references in file order
    assert metrics["test/bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    # and the paper's tokenized compound-split BLEU, computed independently (Moses, ##AT##, multi-bleu)
    assert metrics["test/bleu_tok_compound"] == pytest.approx(by_hand(hyps, refs), abs=1e-6)
    assert metrics["test/chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    check_sentence_scores(predictions, hyps, refs, (data / "test.en").read_text(encoding="utf-8").splitlines())
    assert metrics["test/chrf++"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs], word_order=2).score)


def own_translations(last: Path, demo_cache: Path, data: Path, count: int) -> tuple[Path, list[str], list[str]]:
    """A copy of the demo corpus at ``data`` (its sentencepiece model included), its first ``count`` test
    sources, and the checkpoint's translations of them."""
    import shutil

    from tasks.translate import TranslationTask

    shutil.copytree(next(demo_cache.glob("translate-en-de-v*")), data)
    sources = (data / "test.en").read_text(encoding="utf-8").splitlines()[:count]
    model = TranslationTask.load_from_checkpoint(last, weights_only=True).eval()
    return data, sources, model.tokenizer.decode(model.translate(model.encode_sources(sources)).tokens.tolist())


@pytest.mark.slow  # ~80 s: two more `test` runs
def test_test_reports_the_papers_tokenized_compound_split_bleu(fitted, demo_cache, tmp_path):
    """metrics.json's ``test/bleu_tok_compound`` on references close to what the model says (a 4-step
    model scores 0 on the real ones, which would not tell a right number from a wrong one): the
    demo corpus with 40 test lines whose German references are the model's own translations, some
    with hyphenated compounds, scored as a computation written in the tests scores them. With
    ``tokenized_bleu_moses=master`` the run logs Moses master's score under its own name instead; it
    differs where a reference ends in a non-breaking prefix."""
    from tasks.metrics.bleu import tokenized_compound_split_bleu

    _, _, last, _ = fitted
    data, sources, own = own_translations(last, demo_cache, tmp_path / "data", 40)
    refs = [f"{line} Nord-Süd-Konflikt" if i % 3 == 0 else line.replace(" ", "-", 1) if i % 3 == 1
            else f"{line} vor 7 Q." if i % 6 == 2 else line for i, line in enumerate(own)]
    (data / "test.en").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    (data / "test.de").write_text("".join(line + "\n" for line in refs), encoding="utf-8")
    metrics, hypotheses = {}, {}
    for moses in ("paper", "master"):
        cwd = tmp_path / moses
        cwd.mkdir()
        run_in(cwd, "test", *TINY, "--ckpt_path", str(last), "--data.root", str(data),
               "--model.tokenized_bleu_moses", moses)
        predictions = cwd / "runs" / "translate" / "predictions"
        hypotheses[moses] = (predictions / "hypotheses.txt").read_text(encoding="utf-8").split("\n")[:-1]
        metrics[moses] = json.loads((predictions / "metrics.json").read_text())
    paper, master, hyps = metrics["paper"], metrics["master"], hypotheses["paper"]
    assert hypotheses["master"] == hyps
    assert paper["test/bleu_tok_compound"] == pytest.approx(by_hand(hyps, refs), abs=1e-6)
    assert paper["test/bleu_tok_compound"] > 10
    assert paper["test/bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert set(master) - set(paper) == {"test/bleu_tok_compound_moses_master"}
    assert set(paper) - set(master) == {"test/bleu_tok_compound"}
    assert master["test/bleu_tok_compound_moses_master"] == pytest.approx(
        tokenized_compound_split_bleu(hyps, refs, "de", "master"), abs=1e-6)
    assert master["test/bleu_tok_compound_moses_master"] != pytest.approx(paper["test/bleu_tok_compound"], abs=1e-3)


@pytest.mark.slow  # two CLI runs, ~30 s
def test_bom_and_cr_only_files_score_and_translate_like_clean_ones(fitted, demo_cache, tmp_path):
    """Text hygiene end to end: `test` against references with a byte order mark and old-Mac line breaks
    that equal the model's own translations scores BLEU 100 (a BOM kept in the text would cost 4 points on 10 lines);
    `predict` reads such a file line by line and warns about the line it truncates."""
    _, _, last, _ = fitted
    data, sources, own = own_translations(last, demo_cache, tmp_path / "data", 10)
    (data / "test.en").write_bytes(("\ufeff" + "\r".join(sources) + "\r").encode("utf-8"))
    (data / "test.de").write_bytes(("\ufeff" + "\r\n".join(own) + "\r\n").encode("utf-8"))
    run_in(tmp_path, "test", *TINY, "--ckpt_path", str(last), "--data.root", str(data))
    predictions = tmp_path / "runs" / "translate" / "predictions"
    assert (predictions / "hypotheses.txt").read_text(encoding="utf-8").split("\n")[:-1] == own
    assert json.loads((predictions / "metrics.json").read_text())["test/bleu"] == pytest.approx(100.0)

    text = tmp_path / "in.en"
    text.write_bytes(("\ufeffGermany\r" + " ".join(["Germany"] * 5000) + "\r").encode("utf-8"))
    out = tmp_path / "out.de"
    proc = run_in(tmp_path, "predict", *TINY, "--ckpt_path", str(last), "--data.predict_path", str(text),
                  "--model.predict_output", str(out))
    assert len(out.read_text(encoding="utf-8").split("\n")) == 2 + 1
    limit = torch.load(last, map_location="cpu", weights_only=False)["hyper_parameters"]["max_positions"] - 1
    assert (f"predict: 1 of 2 lines had more than {limit} tokens and were truncated to {limit} tokens (the model's "
            f"max_positions {limit + 1}, eos included); the first is line 2") in proc.stderr


def check_sentence_scores(predictions: Path, hyps: list[str], refs: list[str], sources: list[str]) -> None:
    """bleu_signature.txt is sacreBLEU's; hypotheses.tsv holds every line in order with its sentence scores."""
    import csv

    bleu = sacrebleu.BLEU(tokenize="13a")
    bleu.corpus_score(hyps, [refs])
    assert (predictions / "bleu_signature.txt").read_text(encoding="utf-8").strip() == str(bleu.get_signature())
    with open(predictions / "hypotheses.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows[0] == ["line", "bleu", "chrf", "source", "reference", "hypothesis"]
    assert [int(r[0]) for r in rows[1:]] == list(range(1, len(hyps) + 1))
    assert [r[5] for r in rows[1:]] == hyps and [r[4] for r in rows[1:]] == refs and [r[3] for r in rows[1:]] == sources
    for r, hyp, ref in zip(rows[1:], hyps, refs):
        assert float(r[1]) == pytest.approx(sacrebleu.sentence_bleu(hyp, [ref]).score, abs=1e-9)
        assert float(r[2]) == pytest.approx(sacrebleu.sentence_chrf(hyp, [ref]).score, abs=1e-9)
    # worst/worst.tsv: the 16 lowest sentence chrF, lowest first (ties in file order), rows as in hypotheses.tsv
    with open(predictions / "worst" / "worst.tsv", encoding="utf-8", newline="") as f:
        worst = list(csv.reader(f, delimiter="\t"))
    assert worst[0] == ["rank", *rows[0]]
    expected = sorted(rows[1:], key=lambda r: (float(r[2]), int(r[0])))[:16]
    assert [r[1:] for r in worst[1:]] == expected and [int(r[0]) for r in worst[1:]] == list(range(1, 17))


@pytest.mark.slow  # ~20 s; the contract matrix keeps a translate predict cell in the default run
def test_predict_translates_stdin_to_stdout_and_a_file_to_a_file(fitted, tmp_path):
    cwd, root, last, _ = fitted
    lines = ["Germany", "", "7 kilometers per hour"]
    proc = run_in(cwd, "predict", *TINY, "--ckpt_path", str(last), "--data.predict_path", "-",
                  stdin="".join(line + "\n" for line in lines))
    # standard output holds the translations only (progress, wandb and logs go to stderr)
    assert len(proc.stdout.split("\n")) == len(lines) + 1 and proc.stdout.endswith("\n"), proc.stdout
    src = tmp_path / "in.en"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out" / "hyps.de"
    run_in(cwd, "predict", *TINY, "--ckpt_path", str(last), "--data.predict_path", str(src),
           "--model.predict_output", str(out))
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == proc.stdout.splitlines()


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs" / "translate").glob("*.yaml") if is_recipe(p)))
def test_every_recipe_parses(recipe, capsys):
    from tasks.translate import main

    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(REPO / "configs" / "translate" / recipe), "--print_config"])
    assert done.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["use_distributed_sampler"] is False
    assert config["model"]["optimizer"]["init_args"]["betas"] == [0.9, 0.98]


@pytest.mark.slow
def test_two_process_ddp_test_scores_every_sentence_once_and_equals_one_process(tmp_path, demo_cache):
    """`test` on 2 CPU processes (gloo) writes the same hypotheses and metrics as on one."""
    data = next(demo_cache.glob("translate-en-de-v*"), None)
    if data is None:
        from datamodules.demo_text import demo_translation_root

        data = demo_translation_root()
    root = tmp_path / "small"
    root.mkdir()
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            lines = (data / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[: 400 if split == "train" else 41]
            (root / f"{split}.{lang}").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    outputs = {}
    for devices in (1, 2):
        cwd = tmp_path / f"run{devices}"
        cwd.mkdir()
        extra = ["--trainer.strategy", "ddp"] if devices == 2 else []
        run_in(cwd, "test", *TINY, "--data.root", str(root), "--data.vocab_size", "300", "--data.eval_max_tokens", "40",
               "--trainer.accelerator", "cpu", "--trainer.devices", str(devices), *extra)
        predictions = cwd / "runs" / "translate" / "predictions"
        outputs[devices] = ((predictions / "hypotheses.txt").read_text(encoding="utf-8"),
                            json.loads((predictions / "metrics.json").read_text()),
                            (predictions / "hypotheses.tsv").read_text(encoding="utf-8"),
                            (predictions / "bleu_signature.txt").read_text(encoding="utf-8"))
    assert len(outputs[2][0].split("\n")) == 41 + 1
    assert outputs[2][0] == outputs[1][0]
    assert outputs[2][1] == pytest.approx(outputs[1][1], rel=1e-5)
    assert outputs[2][2:] == outputs[1][2:]  # per-sentence scores and signature from every rank's sentences
