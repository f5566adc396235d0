"""Translation speed and quality, measured side by side in one process.

    python benchmarks/bench_translate.py speed  [--threads 2] [--dims demo|base] [--repeats 5] [--decode-only]
    python benchmarks/bench_translate.py curve  [--out runs/bench_translate_curve] [CLI overrides]

``speed``:
- training tokens/s (source + target, padding excluded) of the demo recipe's model on
  demo-corpus batches, forward + backward + Adam step;
- beam-search sentences/s, beam 4, batch 32, exactly 64 output tokens per sentence (eos
  blocked until then, so both sides do the same work with random weights), ours vs
  Hugging Face transformers' ``MarianMTModel`` built with the same dimensions (post-norm,
  ReLU, scaled embeddings, sinusoidal positions, tied embeddings) and random weights; the
  peer is skipped with a note when ``transformers`` is not installed (it is a
  benchmark-only dependency: ``pip install transformers``);
- cached vs uncached decoding (the prefix recomputed every step) at 64 output tokens.

Ours and the peer run interleaved (ours, peer, ours, ...) and each reports its best wall time and
its best process-CPU time over ``--repeats``; on a shared machine the CPU-time ratio is the steadier one.

``curve``: the default ``python -m tasks.translate fit`` (demo recipe) with a callback that
records wall time, process CPU time, val BLEU and chrF after every validation, then
`test` on the best checkpoint; writes ``curve.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIMS = {  # (dim, layers per side, heads, ffn): the demo recipe and the paper's base model
    "demo": (256, 2, 4, 1024),
    "base": (512, 6, 8, 2048),
}


def timed(fn, repeats: int) -> float:
    """Best-of-``repeats`` seconds of one call (after one warm-up call)."""
    return timed_side_by_side({"fn": fn}, repeats)["fn"][0]


def timed_side_by_side(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (best wall seconds, best process-CPU seconds) of one call, the calls interleaved
    (a, b, a, b, ...) so that both sides meet the same load on a shared machine; one warm-up each."""
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def our_model(vocab: int, dims: str):
    from tasks.translate import TranslationTask

    dim, depth, heads, ffn = DIMS[dims]
    return TranslationTask(vocab, dim=dim, encoder_depth=depth, decoder_depth=depth, num_heads=heads, ffn_dim=ffn,
                           max_positions=256, beam_size=4, length_penalty=0.6)


def marian_model(vocab: int, dims: str):
    from transformers import MarianConfig, MarianMTModel

    dim, depth, heads, ffn = DIMS[dims]
    config = MarianConfig(vocab_size=vocab, d_model=dim, encoder_layers=depth, decoder_layers=depth,
                          encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                          decoder_ffn_dim=ffn, activation_function="relu", max_position_embeddings=256,
                          scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
                          pad_token_id=0, eos_token_id=3, decoder_start_token_id=2, forced_eos_token_id=None,
                          dropout=0.1)
    return MarianMTModel(config)


def source_batch(batch_size: int = 32):
    from datamodules.wmt import TranslationDataModule

    dm = TranslationDataModule(vocab_size=2000, eval_max_tokens=10**6)
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    order = torch.argsort(batch["src"].ne(0).sum(1), descending=True)  # the longest test sentences
    src = batch["src"][order[:batch_size]]
    return src[:, : int(src.ne(0).sum(1).max())], dm


def bench_training(model, dm, steps: int, repeats: int) -> dict:
    dm.setup("fit")
    batches = [b for _, b in zip(range(steps), dm.train_dataloader())]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))
    from tasks.translate import label_smoothed_nll

    model.train()

    def run():
        for b in batches:
            loss, _, n = label_smoothed_nll(model(b["src"], b["tgt_in"]), b["tgt_out"], 0.1, 0)
            (loss / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    seconds = timed(run, repeats)
    tokens = sum(int(b["src"].ne(0).sum()) + int(b["tgt_out"].ne(0).sum()) for b in batches)
    return {"train_tokens_per_s": tokens / seconds, "steps": steps, "tokens": tokens, "seconds": seconds}


def bench_decoding(dims: str, vocab: int, src: torch.Tensor, out_len: int = 64, repeats: int = 2) -> dict:
    from heads.decoding import beam_search

    torch.manual_seed(0)
    ours = our_model(vocab, dims).eval()
    b = src.shape[0]
    max_len = torch.full((b,), out_len)

    def ours_beam(use_cache=True):
        memory, padding = ours.encoder(src)
        return beam_search(ours.decoder, memory, padding, max_len, beam_size=4, alpha=0.6, bos_id=2, eos_id=3,
                           pad_id=0, min_len=out_len, use_cache=use_cache)

    with torch.inference_mode():
        uncached = timed(lambda: ours_beam(use_cache=False), 1)
        try:
            marian = marian_model(vocab, dims).eval()
        except ImportError:
            result = {"ours_beam4_sentences_per_s": b / timed(ours_beam, repeats),
                      "marian": "transformers not installed: pip install transformers (benchmark-only dependency)"}
            result["ours_uncached_beam4_sentences_per_s"] = b / uncached
            result["cache_speedup"] = result["ours_beam4_sentences_per_s"] * uncached / b
            return result
        n_ours = sum(p.numel() for p in ours.parameters())
        n_marian = sum(p.numel() for p in marian.parameters() if p.requires_grad)
        attention_mask = src.ne(0)

        def marian_beam():
            return marian.generate(input_ids=src, attention_mask=attention_mask, num_beams=4, length_penalty=0.6,
                                   max_new_tokens=out_len, min_new_tokens=out_len, early_stopping=False,
                                   do_sample=False, use_cache=True)

        out = marian_beam()
        assert out.shape[1] >= out_len, out.shape
        best = timed_side_by_side({"ours": ours_beam, "marian": marian_beam}, repeats)
        result = {"ours_beam4_sentences_per_s": b / best["ours"][0],
                  "marian_beam4_sentences_per_s": b / best["marian"][0],
                  "ours_vs_marian": best["marian"][0] / best["ours"][0],
                  "ours_vs_marian_cpu_seconds": best["marian"][1] / best["ours"][1],
                  "best_cpu_seconds_ours_marian": [round(best["ours"][1], 3), round(best["marian"][1], 3)],
                  "ours_uncached_beam4_sentences_per_s": b / uncached}
        result["cache_speedup"] = result["ours_beam4_sentences_per_s"] * uncached / b
        result["params_ours_marian"] = [n_ours, n_marian]
    return result


def speed(args) -> dict:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    torch.set_num_threads(args.threads)
    src, dm = source_batch(32)
    vocab = dm.vocab_size
    report = {"threads": args.threads, "torch": torch.__version__, "dims": args.dims, "vocab": vocab,
              "batch": list(src.shape)}
    if not args.decode_only:
        torch.manual_seed(0)
        report.update(bench_training(our_model(vocab, args.dims), dm, args.train_steps, args.repeats))
    report.update(bench_decoding(args.dims, vocab, src, repeats=args.repeats))
    return report


def curve(args) -> dict:
    """The default fit with a recorder callback, then `test` on the best checkpoint."""
    from lightning.pytorch import Callback

    from tasks.translate import main

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    points = []
    start = time.perf_counter()

    class Recorder(Callback):
        def on_validation_end(self, trainer, pl_module):
            if trainer.sanity_checking:
                return
            m = trainer.callback_metrics
            points.append({"epoch": trainer.current_epoch, "step": trainer.global_step,
                           "wall_s": round(time.perf_counter() - start, 1),
                           "cpu_s": round(time.process_time(), 1),
                           "val_bleu": round(float(m["val/bleu"]), 2), "val_chrf": round(float(m["val/chrf"]), 2)})
            (out / "curve.json").write_text(json.dumps({"points": points}, indent=1))
            print("CURVE", points[-1], flush=True)

    import tasks.cli.suite as cli

    recorder = Recorder()
    original = cli.SuiteCLI.instantiate_trainer

    def with_recorder(self, **kwargs):
        trainer = original(self, **kwargs)
        trainer.callbacks.append(recorder)
        return trainer

    cli.SuiteCLI.instantiate_trainer = with_recorder
    try:
        main(["fit", "--trainer.default_root_dir", str(out), *args.extra])
    except SystemExit:
        pass
    best = next(out.rglob("best-*.ckpt"))
    try:
        main(["test", "--trainer.default_root_dir", str(out), "--ckpt_path", str(best), *args.extra])
    except SystemExit:
        pass
    test = json.loads((out / "predictions" / "metrics.json").read_text())
    result = {"points": points, "test": test, "fit_wall_s": points[-1]["wall_s"] if points else None}
    (out / "curve.json").write_text(json.dumps(result, indent=1))
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--dims", choices=sorted(DIMS), default="demo")
    s.add_argument("--train-steps", type=int, default=10)
    s.add_argument("--repeats", type=int, default=2, help="timed repeats (best of), after one warm-up")
    s.add_argument("--decode-only", action="store_true", help="skip the training-throughput measurement")
    c = sub.add_parser("curve", epilog="Any other arguments are CLI overrides for the fit and the test, "
                                         "e.g. --trainer.max_epochs 5")
    c.add_argument("--out", default="runs/bench_translate_curve")
    args, overrides = parser.parse_known_args(argv)  # overrides keep their order, e.g. --trainer.max_epochs 5
    if overrides and args.what != "curve":
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.extra = overrides
    return args


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    args = parse_args()
    result = speed(args) if args.what == "speed" else curve(args)
    print(json.dumps(result, indent=1))
