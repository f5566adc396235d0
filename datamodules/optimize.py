"""Convert a dataset in its standard layout into LitData's optimized chunks, once.

    python -m datamodules.optimize --task classify --root /data/imagenet --output s3://bucket/imagenet
    python -m datamodules.optimize --task detect --root /data/coco --output /nvme/coco --num-workers 32
    python -m datamodules.optimize --task detect --config configs/detect/voc_ssdlite_mobilevitv2_100.yaml \\
        --output s3://bucket/voc0712
    python -m datamodules.optimize --task segment --root /data/ADEChallengeData2016 --data.dataset ade20k \\
        --output s3://bucket/ade20k
    python -m datamodules.optimize --task translate --config configs/translate/wmt14_en_de_transformer_base.yaml \\
        --root /data/wmt14_en_de --output s3://bucket/wmt14

The task's datamodule reads the dataset exactly as training does (a broken annotation stops the
conversion naming its file), and every split becomes a LitData dataset ``OUT/<split>/``; the
manifest ``OUT/streaming.json``, written last, records the task, the splits and what the model
learns from the data: class names, COCO categories, the sentencepiece model trained on the
training split. Encoded images are stored as they are. Translation splits also get their token
arrays, ``OUT/<split>.tokens/`` (the prepared index of :mod:`datamodules.wmt`), which is what a
streamed translation training reads.

The datamodule is configured as for training: ``--config RECIPE`` takes the recipe's ``data``
section (its class and arguments); ``--data <class path>``, ``--data.<name> <value>`` (values are
YAML) and ``--root`` override it. Without any root the task's demo data is converted. Train from
the result with ``--data.streaming_root OUT``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Sequence

import yaml

from configs.recipes import class_arguments, merge, resolve_recipes, split_command_line
from configs.tasks import task_declaration, task_names
from datamodules.streaming import LAYOUT_VERSION, join, read_manifest, split_folder, split_key, write_manifest, \
    write_split


def data_settings(argv: Sequence[str]) -> tuple[str | None, dict]:
    """``(class path or None, arguments)`` of the datamodule that the recipes (``--config``, resolved as the
    task's CLI resolves them, without its default recipe) and the ``--data`` / ``--data.<name> <value>``
    flags (YAML values) describe."""
    command = split_command_line(argv)
    data = resolve_recipes(command, default=None).get("data") or {}
    for flag in command.flags:
        if flag.name != "data" and not flag.name.startswith("data."):
            raise SystemExit(f"unrecognised argument --{flag.name} (datamodule arguments are --data.<name> <value>)")
        if flag.value is None:
            raise SystemExit(f"--{flag.name} needs a value")
        if flag.name == "data":  # another class for the same arguments
            data = {"class_path": flag.value, "init_args": class_arguments(data)}
        else:
            data = merge(data, {"init_args": {flag.name[len("data."):]: yaml.safe_load(flag.value)}})
    return data.get("class_path"), class_arguments(data)


def datamodule_class(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise SystemExit(f"--data {path}: no such datamodule class") from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m datamodules.optimize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=task_names())
    parser.add_argument("--root", help="the dataset in its standard layout "
                                       "(default: the recipe's, else the task's demo data)")
    parser.add_argument("--output", required=True, help="a folder or an object-store URL (s3://, gs://, ...)")
    parser.add_argument("--splits", nargs="+", help="splits to convert (default: those the datamodule reads)")
    parser.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="conversion processes")
    parser.add_argument("--chunk-bytes", default="64MB", help="LitData chunk size (default 64MB)")
    parser.epilog = ("--config RECIPE (one or more: its data section configures the datamodule), --data CLASS_PATH "
                     "and --data.<name> <value>: the datamodule, as for the task's fit")
    args, rest = parser.parse_known_args(argv)
    class_path, arguments = data_settings(rest)
    if args.root is not None:
        arguments["root"] = args.root
    if args.output.startswith("local:"):  # LitData's way of reading a folder as a store; written as a folder
        args.output = args.output[len("local:"):]

    cls = datamodule_class(class_path or task_declaration(args.task).datamodule)
    if getattr(cls, "streaming_task", None) != args.task:
        raise SystemExit(f"{cls.__module__}.{cls.__name__} is not a datamodule of task {args.task}")
    arguments.pop("streaming_root", None)
    datamodule = cls(**arguments)
    sources = datamodule.streaming_sources(args.splits)
    info = datamodule.streaming_info()

    splits = {}
    try:  # splits converted by an earlier run stay listed when they describe the same data
        earlier = read_manifest(args.output, cls.streaming_layout)
        if earlier["data"] == info:
            splits = earlier["splits"]
    except (FileNotFoundError, ValueError):
        pass
    for name, dataset in sources.items():
        key = split_key(name)
        print(f"{key}: {len(dataset)} samples -> {join(args.output, split_folder(key))}", flush=True)
        write_split(args.output, key, len(dataset), dataset.stored_sample, args.num_workers, args.chunk_bytes)
        splits[key] = {"folder": split_folder(key), "samples": len(dataset)}
        if hasattr(dataset, "store_beside"):  # what a streamed split needs besides its samples (translation)
            splits[key].update(dataset.store_beside(args.output, split_folder(key)))
    write_manifest(args.output, {
        "format": "visionlang-suite streaming", "version": LAYOUT_VERSION, "task": args.task,
        "layout": cls.streaming_layout, "datamodule": f"{cls.__module__}.{cls.__name__}",
        "source": str(datamodule.root), "splits": splits, "data": info,
    })
    print(f"optimized dataset: {args.output} (splits {', '.join(sorted(splits))}); train with "
          f"--data.streaming_root {args.output}", file=sys.stderr)


if __name__ == "__main__":
    from layers.errors import refusals_as_messages

    with refusals_as_messages():  # a refusal: its message and exit 1 (SUITE_DEBUG=1 shows the traceback)
        main()
