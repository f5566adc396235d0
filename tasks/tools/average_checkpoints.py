"""Average the weights of several checkpoints of one training run into one checkpoint, as the
Transformer paper and fairseq's WMT recipes do before scoring (the last 5 or 20 checkpoints):

    python -m tasks.tools.average_checkpoints runs/translate/checkpoints --last 5 --output runs/translate/averaged.ckpt
    python -m tasks.tools.average_checkpoints a.ckpt b.ckpt c.ckpt --output averaged.ckpt
    python -m tasks.translate test --ckpt_path runs/translate/averaged.ckpt

``--last N`` picks the N checkpoints of a folder with the highest training step, read from each
checkpoint (``global_step``), not from file names or times; ``last.ckpt`` and a step checkpoint
of the same step count once. Floating-point tensors of the ``state_dict`` are averaged (in
float64, stored in their own dtype); integer and boolean buffers (BatchNorm's
``num_batches_tracked``) are the newest checkpoint's. Everything else that makes the checkpoint
usable on its own (hyper-parameters, the task, translation's tokenizer, the wandb group) is the
newest checkpoint's too, so ``validate``/``test``/``predict --ckpt_path`` take the result like any
checkpoint of the task. The training state (optimizer, schedulers, loop positions, callbacks,
RNG states) is left out: an average is no point to resume training from, and ``fit --ckpt_path``
refuses it. The sources are recorded as ``averaged_from`` (file name and step of each).

Checkpoints of different tasks, with different weight names or shapes, or a different tokenizer
are refused, naming the files. So are checkpoints of two different training runs (each fit
records a run id that its resumes keep; checkpoints without a run id are told apart by their wandb group)
and checkpoints with different hyper-parameters: averaging those is a deliberate choice
("model soups" of fine-tunings), made with ``--force``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tasks.cli.checkpoint_io import save_atomically
from tasks.engine.checkpoints import read_checkpoint

#: top-level checkpoint entries that only resuming `fit` reads; an averaged checkpoint has none
TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "rng_states",
                  # EMAWeightAveraging: the raw weights next to the averaged ones, and its own counters
                  "current_model_state", "averaging_state",
                  # the mixed-precision plugin's gradient scaler
                  "MixedPrecision",
                  # the settings a resume is checked against (tasks.cli.resume)
                  "suite_resume")


def average_checkpoints(paths: list[str | Path], force: bool = False) -> dict:
    """The checkpoint whose ``state_dict`` is the element-wise mean of the given checkpoints'.

    The newest checkpoint (highest ``global_step``) supplies integer buffers and everything
    outside the ``state_dict``; the training state is dropped (:data:`TRAINING_STATE`).
    ``force`` accepts checkpoints of different runs or hyper-parameters (not of different networks)."""
    if not paths:
        raise ValueError("no checkpoints to average")
    checkpoints = [(Path(p), read_checkpoint(p)) for p in paths]
    check_averageable(checkpoints, force)
    newest_path, newest = max(checkpoints, key=lambda item: item[1].get("global_step", -1))

    sums: dict[str, torch.Tensor] = {}
    for _, checkpoint in checkpoints:
        for name, tensor in checkpoint["state_dict"].items():
            if tensor.is_floating_point():
                sums[name] = sums[name] + tensor.double() if name in sums else tensor.double()
    state_dict = {}
    averaged_by_storage: dict[int, torch.Tensor] = {}  # tied weights (shared embeddings) stay one tensor
    for name, tensor in newest["state_dict"].items():
        if not tensor.is_floating_point():
            state_dict[name] = tensor.clone()
            continue
        key = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
        if key not in averaged_by_storage or averaged_by_storage[key].shape != tensor.shape:
            averaged_by_storage[key] = (sums[name] / len(checkpoints)).to(tensor.dtype)
        state_dict[name] = averaged_by_storage[key]

    averaged = {key: value for key, value in newest.items() if key not in TRAINING_STATE}
    averaged["state_dict"] = state_dict
    averaged["averaged_from"] = [[path.name, int(checkpoint.get("global_step", -1))]
                                 for path, checkpoint in checkpoints]
    return averaged


def run_of(checkpoint: dict) -> str | None:
    """The training run a checkpoint belongs to: its run id, else its wandb group, else ``None``."""
    run = checkpoint.get("suite_run") or {}
    if run.get("id"):
        return f"run {run['id'][:8]} in {run.get('root')}"
    return f"wandb group {checkpoint['wandb_group']}" if checkpoint.get("wandb_group") else None


def check_averageable(checkpoints: list[tuple[Path, dict]], force: bool = False) -> None:
    """Refuse checkpoints that are not snapshots of one network: another task, other weight names,
    shapes or dtypes, or another tokenizer; and, unless ``force``, snapshots of different training
    runs or with other hyper-parameters. The message names the files."""
    first_path, first = checkpoints[0]
    for path, checkpoint in checkpoints[1:]:
        pair = f"{first_path} and {path}"
        ours, theirs = run_of(first), run_of(checkpoint)
        if not force and ours and theirs and ours != theirs:
            raise ValueError(f"cannot average {pair}: they come from different training runs ({first_path.name}: "
                             f"{ours}; {path.name}: {theirs}). Average the last checkpoints of one run, or pass "
                             "--force to average different runs deliberately")
        if checkpoint.get("suite_task") != first.get("suite_task"):
            raise ValueError(f"cannot average checkpoints of different tasks: {first_path} is "
                             f"{first.get('suite_task')}, {path} is {checkpoint.get('suite_task')}")
        ours, theirs = first["state_dict"], checkpoint["state_dict"]
        if ours.keys() != theirs.keys():
            only_ours, only_theirs = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
            raise ValueError(f"cannot average {pair}: their weights differ by name (only in the first: "
                             f"{only_ours[:5]}, only in the second: {only_theirs[:5]})")
        for name, tensor in ours.items():
            other = theirs[name]
            if tensor.shape != other.shape or tensor.dtype != other.dtype:
                raise ValueError(f"cannot average {pair}: {name} is {tuple(tensor.shape)} {tensor.dtype} in the first "
                                 f"and {tuple(other.shape)} {other.dtype} in the second")
        ours, theirs = first.get("hyper_parameters", {}), checkpoint.get("hyper_parameters", {})
        differing = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        if differing and not force:
            shown = "; ".join(f"{k}: {ours.get(k)!r} vs {theirs.get(k)!r}" for k in differing[:5])
            raise ValueError(f"cannot average {pair}: their hyper-parameters differ ({shown}); pass --force "
                             "to average them deliberately")
        if "tokenizer" in first or "tokenizer" in checkpoint:
            if not ("tokenizer" in first and "tokenizer" in checkpoint
                    and torch.equal(first["tokenizer"], checkpoint["tokenizer"])):
                raise ValueError(f"cannot average {pair}: they were trained with different sentencepiece vocabularies")


def last_checkpoints(folder: str | Path, count: int) -> list[Path]:
    """The ``count`` checkpoints in ``folder`` and its ``checkpoints/`` subfolder (so a run's root works
    too) with the highest ``global_step``, oldest first; one file per step. Averages written there
    before are not candidates."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    files = [*folder.glob("*.ckpt"), *(folder / "checkpoints").glob("*.ckpt")]
    by_step: dict[int, Path] = {}
    groups: dict[int, object] = {}
    # sorted, so that of two files of one step the choice does not depend on the file system;
    # last.ckpt sorts after best-*/step-*, whose copy of the same step is kept
    for path in sorted(files, key=lambda p: (p.name == "last.ckpt", str(p))):
        checkpoint = read_checkpoint(path)
        if "averaged_from" in checkpoint:
            continue
        step = int(checkpoint.get("global_step", -1))
        by_step.setdefault(step, path)
        groups.setdefault(step, run_of(checkpoint))
    steps = sorted(by_step)[-count:]
    if len(steps) < count:
        raise ValueError(f"--last {count}: {folder} holds checkpoints of {len(by_step)} training step(s) "
                         f"({', '.join(f'{by_step[s].name} at step {s}' for s in sorted(by_step)) or 'none'}). "
                         "Keep more with --checkpoint.monitor step --checkpoint.mode max --checkpoint.save_top_k N "
                         "--checkpoint.every_n_train_steps K, or average fewer.")
    chosen_groups = {groups[s] for s in steps} - {None}
    if len(chosen_groups) > 1:
        raise ValueError(f"--last {count}: the newest checkpoints in {folder} come from different training runs "
                         f"({sorted(map(str, chosen_groups))}: "
                         f"{', '.join(f'{by_step[s].name} {groups[s]}' for s in steps)}). "
                         "Name the checkpoints to average explicitly.")
    return [by_step[s] for s in steps]


def save_checkpoint(checkpoint: dict, path: str | Path) -> Path:
    """Write atomically (a partial file never carries the final name; see :mod:`tasks.cli.checkpoint_io`)."""
    save_atomically(checkpoint, path)
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.tools.average_checkpoints",
        description="Average the weights of checkpoints of one training run into one checkpoint "
                    "(the Transformer paper's and fairseq's last-N checkpoint averaging).")
    parser.add_argument("inputs", nargs="+", help="checkpoint files, or one folder of checkpoints with --last N")
    parser.add_argument("--last", type=int, metavar="N", help="average the N checkpoints of the folder with the "
                        "highest training steps")
    parser.add_argument("--output", "-o", required=True, help="where to write the averaged checkpoint")
    parser.add_argument("--force", action="store_true", help="average checkpoints of different training runs or "
                        "with different hyper-parameters (the networks must still match)")
    args = parser.parse_args(argv)

    try:
        if args.last is not None:
            if len(args.inputs) != 1 or not Path(args.inputs[0]).is_dir():
                parser.error("--last N takes one folder of checkpoints (a run's checkpoints/ or its root)")
            if args.last < 1:
                parser.error("--last N needs N >= 1")
            paths = last_checkpoints(args.inputs[0], args.last)
        else:
            folders = [p for p in args.inputs if Path(p).is_dir()]
            if folders:
                parser.error(f"{folders[0]} is a folder: give --last N to choose its newest checkpoints")
            paths = [Path(p) for p in args.inputs]
        output = Path(args.output)
        if any(output.resolve() == p.resolve() for p in paths):
            parser.error(f"--output {output} is one of the checkpoints to average; write the average elsewhere")
        averaged = average_checkpoints(paths, force=args.force)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    save_checkpoint(averaged, output)
    steps = ", ".join(f"{name} (step {step})" for name, step in averaged["averaged_from"])
    task = averaged.get("suite_task") or "the task"
    print(f"averaged {len(paths)} checkpoints: {steps}\n"
          f"wrote {output.resolve()}\n"
          f"score it with: python -m {task.rsplit('.', 1)[0]} test --ckpt_path {output}")


if __name__ == "__main__":
    main()
