"""GPU suite: training-step and inference throughput of every task's network beside its peer, one command.

    python benchmarks/gpu_suite.py                  # CUDA machine: the whole suite (time-budgeted, < 10 min)
    python benchmarks/gpu_suite.py --tiny           # CPU smoke run at toy sizes, < 1 min (tests/test_gpu_suite.py)
    python benchmarks/gpu_suite.py --check-env      # which optional packages / features are missing

For each task (classify, detect, segment, translate) and each of two recipes -- the demo recipe
and one paper recipe, at the recipe's full resolution and per-device batch -- it builds the task
class from the recipe's YAML (``configs/*/*.yaml``, its ``base:`` chain included) the way
``python -m tasks.<task> fit --config <recipe>`` does: the model section goes through jsonargparse's
parser of ``ClassificationTask``, ``DetectionTask``, ``SegmentationTask`` or ``TranslationTask``;
batch, resolution, gradient clipping and ``channels_last`` are the recipe's; what the CLI would
link from the dataset (class count, vocabulary) is the suite's (it loads no data). It times the
task's training step in a plain loop, in ``bf16-mixed`` and ``16-mixed``, with and without
``channels_last`` and ``torch.compile``; the same sizes run through the peers in the same process
(timm ``mobilevitv2_050/100``, torchvision ``ssdlite320_mobilenet_v3_large`` and
``deeplabv3_mobilenet_v3_large``, Hugging Face ``MarianMTModel`` configured to the translation
recipe's dimensions -- post-norm, sinusoidal positions, ReLU, shared and tied embeddings, SDPA --
random weights: nothing is downloaded).

What is measured: the *training step throughput of the network* -- forward, loss, backward,
gradient clipping where the recipe clips, the recipe's optimizer step with the task's parameter
groups (constant learning rate) --
under ``torch.autocast`` with the variant's dtype (``GradScaler`` for 16-mixed), on one fixed
synthetic batch at the recipe's resolution (images uniform in [0, 1], random labels / tokens).
Data loading, augmentation, metrics, logging and the learning-rate schedule are *not* included
(see ``bench_loaders.py`` for loaders). Warm-up steps (which include compilation) are excluded
from timing; the timed steps are bracketed by ``torch.cuda.synchronize``; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (after ``reset_peak_memory_stats``).
Losses: the task's where random targets do -- cross-entropy on random labels for classification
and per-token translation (with the recipe's label smoothing), the segmentation task's per-pixel
loss with its auxiliary head where the recipe has one (the peer: per-pixel cross-entropy); for SSDLite, mean square of the class logits + mean square of the box regression
(the SSD loss needs matched boxes), for ours and the torchvision peer alike. Both detectors run
their network only (torchvision's resize/normalise transform and its loss are bypassed).
Inference of the paper recipes is timed at the MobileViTv2 paper's protocol (its Tables 2-4:
batch 128 for classification at 256 and SSDLite at 320, batch 32 for DeepLabv3 at 512; 10
warm-up then 50 timed iterations, never cut short), in eval mode, ``torch.no_grad``, the row's
autocast: the *network only* -- logits, or SSDLite's class logits and box regression, or the
segmentation logits at the head's resolution (torchvision's DeepLabv3 as well: its forward's final
upsampling is left out). The postprocess column times, on those outputs, what turns them into
predictions: SSDLite's decoding and class-wise NMS (ours: the head's ``postprocess``;
torchvision's: ``postprocess_detections``), segmentation's bilinear upsampling to the input and
argmax (10 timed after 2 warm-up). The paper's V100 images/s is printed beside ours. Translation
times the teacher-forced forward (target tokens/s) at the recipe's batch.

Interleaved rounds (run first, ``--interleaved pairs decide``; :mod:`interleaved`): the single-window rows
below time each variant once, at its own moment, so two rows differ by the machine's mood too (the first GPU run
measured ours/timm 0.94 in one run and 0.84 in the next). For the headline comparisons each paper recipe's
network and its peer (eager, the recipe's channels_last, bf16-mixed) are built once, warmed up, then timed in
``--rounds`` rounds (default 7) of ``--round-steps`` training steps each (default 5), ours and the peer turn about
which goes first, each timing between two CUDA events (the host waits on the end event only; on a CPU the host
clock). Per pair: the median rate of each side, the median of the rounds' ratios ours/peer and their spread
(min-max and interquartile range). The same for each paper network's channels_last on/off x ``--compile``
variants against the recipe's own setting, from which :func:`decide` writes the ``model.channels_last`` and
``model.compile`` each recipe should take (rule: an alternative must win every round; "not measured" where a
variant did not run). A decision group compiles one network class in several layouts and modes in one process:
a second layout may recompile a graph with a dimension marked dynamic (Dynamo's automatic dynamic shapes) where a
fit, with one layout, runs a static one; its compiled rows are then a lower bound (see the run's recompile log).
These groups have their own budget (``--interleaved-budget-s``, default half of
``--budget-s``; compiled variants are dropped first); the single-window runs get what is left of ``--budget-s``.

Compilation is the task's own ``--model.compile`` (``TaskModule.configure_model``, :mod:`layers.compile`):
``network`` compiles each sub-network whole (backbone, head; encoder, decoder), ``regional`` only the
blocks each network repeats (its ``repeated_blocks``: transformer layers, mixer blocks), the rest eager.
A peer is compiled whole. The warm-up column's seconds include compilation: for compiled rows they are
the compile time a user waits through. ``cudnn.benchmark`` is on (``--no-cudnn-benchmark`` turns it off).

Time budget: a default run plans 40 eager, 40 network-compiled and 28 regionally compiled variants
(peers at the paper recipes' sizes only; ``--peers all`` adds the demo sizes) -- more than fits in ten minutes when each
compilation takes ~30-60 s. So each run stops timing after ``--max-run-seconds`` (the ``steps``
column says how many were timed), and runs go in order of importance: eager at the recipe's own
settings (bf16-mixed, the recipe's channels_last), eager with one setting changed, compiled at
the paper recipes' own settings, eager with both changed, compiled demo recipes, the remaining
compiled variants; paper recipes before demo ones, ours next to its peer (a task's compiled runs: ours
regional, the peer whole, ours whole). A run whose estimated
end lies past ``--budget-s`` (default 420 s) is not started and is listed as skipped;
``--budget-s 0`` runs everything. Compiled runs keep a place in the budget: eager runs may use
only ``1 - --compiled-share`` of it (default 0.4) when compiled runs are planned. Estimates are
the mean seconds of the runs of the same kind (eager, compiled) measured so far. The files are
rewritten after every run, so an interrupted suite leaves a valid table.

``--tiny``: the same networks on CPU at toy sizes (2 images of 32 px, 2 sentences of 8 tokens,
at most 2,000 words of vocabulary; inference at the same batch, 1 warm-up + 1 timed), 1 warm-up + 2
timed training steps, 1 torch thread, each recipe in
its own layout (``--channels-last recipe``), no compilation unless ``--compile off network regional``;
16-mixed rows are skipped with a note (fp16 autocast with GradScaler is a GPU setting). It
exists so that the suite cannot rot (``tests/test_gpu_suite.py``); its numbers mean nothing.

Outputs (``--output``, default ``benchmarks/gpu_results/``; ``--tiny``: its ``tiny/`` folder):
``gpu_suite.md`` (the interleaved pairs, the decision per paper recipe and its variants, then one table of the
single-window rows) and ``gpu_suite.json`` (``interleaved``: a record per group with a row per variant, each
round's rate and ratio; ``decisions``; ``rows``: every single-window row, the loss curve subsampled; the settings
and the machine).

The suite needs the project's own requirements (torch, PyYAML, jsonargparse); torchvision, timm and
transformers (the project's ``bench`` extra) give the peers (their rows are skipped with a note if
missing), triton is needed for compiled rows on CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib
import importlib.util
import inspect
import json
import math
import platform
import shutil
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))  # interleaved.py

TASKS = ("classify", "detect", "segment", "translate")
RECIPE_NAMES = ("demo", "paper")
PRECISIONS = ("bf16-mixed", "16-mixed")
COMPILES = ("off", "network", "regional")
DEFAULT_OUTPUT = REPO / "benchmarks" / "gpu_results"

MEASURED = ("training step throughput of the network: forward, loss, backward, gradient clipping as the recipe, "
            "optimizer step, under torch.autocast (GradScaler for 16-mixed), on one fixed synthetic batch at the "
            "recipe's resolution and per-device batch; no data loading, augmentation, metrics or logging")
LOSSES = ("cross-entropy on random labels (classification; segmentation per pixel, the task's loss with its "
          "auxiliary head where the recipe has one; translation per target token; label smoothing as the recipe); SSDLite: mean square of class logits + mean square of box regression "
          "(stand-in, the SSD loss needs matched boxes), for ours and the torchvision peer alike")


# --------------------------------------------------------------------------------------------------
# recipes: each network is the task class built from its YAML recipe, as `fit --config` builds it
# --------------------------------------------------------------------------------------------------
#: task -> (module, class) of the LightningModule its CLI trains
TASK_CLASSES = {"classify": ("tasks.classify", "ClassificationTask"), "detect": ("tasks.detect", "DetectionTask"),
                "segment": ("tasks.segment", "SegmentationTask"), "translate": ("tasks.translate", "TranslationTask")}


@dataclass
class Recipe:
    task: str
    name: str                 # "demo" | "paper"
    source: str               # the YAML recipe the network, optimizer, batch and resolution come from
    network: str              # label of our network
    peer: str | None          # label of the peer network (None: no peer)
    num_classes: int = 0      # classes of the recipe's dataset (a data link: the suite loads no data)
    tokens: int = 0           # translation: tokens per source and per target sentence
    timm: str | None = None   # classification peer: timm's name of the same network
    paper_v100: float | None = None  # MobileViTv2 paper, V100 images/s
    paper_batch: int | None = None   # the paper's inference batch for that number
    note: str = ""            # shown on our rows
    size_note: str = ""       # about the full sizes (dropped by --tiny)
    tiny: bool = False        # toy sizes for the CPU smoke run (see :func:`tiny`)

    @property
    def config(self) -> dict:
        """The recipe's keys after its ``base:`` chain (later files win, key by key)."""
        return recipe_config(REPO / self.source)

    @property
    def batch(self) -> int:
        if self.tiny:
            return 2
        data = self.config["data"]
        if self.task == "translate":  # token-batched: sentences of `tokens` tokens up to data.max_tokens per side
            return data["max_tokens"] // self.tokens
        return data["batch_size"]

    @property
    def size(self) -> int:
        """Image side; translation: tokens per source and per target sentence."""
        if self.task == "translate":
            return 8 if self.tiny else self.tokens
        return 32 if self.tiny else self.config["data"]["crop_size" if self.task == "segment" else "image_size"]

    @property
    def clip(self) -> float:
        return self.config.get("trainer", {}).get("gradient_clip_val") or 0.0

    @property
    def channels_last(self) -> bool:
        """The recipe's own setting."""
        return bool(self.config["model"].get("channels_last", False))

    @property
    def compile(self) -> str:
        """The recipe's own ``model.compile`` as a variant: "off", "network" or "regional"."""
        from layers.compile import compile_mode

        return compile_mode(self.config["model"].get("compile", False)) or "off"

    @property
    def data_links(self) -> dict:
        """The constructor arguments the task's CLI links from the datamodule."""
        if self.task == "translate":
            data = self.config["data"]
            vocab = min(data["vocab_size"], 2000) if self.tiny else data["vocab_size"]
            return {"vocab_size": vocab, "max_positions": data["max_positions"]}
        if self.task == "detect":
            return {"num_classes": self.num_classes}
        return {"class_names": [str(i) for i in range(self.num_classes)]}

    @property
    def infer_batch(self) -> int:
        """Inference batch: the paper's for its throughput rows, else the training batch."""
        return 2 if self.tiny else (self.paper_batch or self.batch)

    @property
    def times_inference(self) -> bool:
        """The paper recipes' rows time inference (the paper's protocol for its three networks)."""
        return self.name == "paper"

    @property
    def unit(self) -> str:
        return "tok/s" if self.task == "translate" else "img/s"

    @property
    def items_per_step(self) -> int:
        return self.batch * self.size if self.task == "translate" else self.batch

    @property
    def input(self) -> str:
        if self.task == "translate":
            return f"{self.batch}x({self.size}+{self.size}) tok"
        return f"{self.batch}x{self.size}²"


RECIPES: list[Recipe] = [
    Recipe("classify", "demo", "configs/classify/demo_mobilevitv2.yaml", "MobileViTv2-0.5", "timm mobilevitv2_050",
           num_classes=10, timm="mobilevitv2_050"),
    Recipe("classify", "paper", "configs/classify/imagenet_mobilevitv2_100.yaml", "MobileViTv2-1.0",
           "timm mobilevitv2_100", num_classes=1000, timm="mobilevitv2_100", paper_v100=2351, paper_batch=128),
    Recipe("detect", "demo", "configs/detect/demo_ssdlite_mobilevitv2.yaml", "SSDLite-MobileViTv2-0.5",
           "torchvision ssdlite320_mobilenet_v3_large", num_classes=10),
    Recipe("detect", "paper", "configs/detect/coco_ssdlite_mobilevitv2_050.yaml", "SSDLite-MobileViTv2-0.5",
           "torchvision ssdlite320_mobilenet_v3_large", num_classes=80, paper_v100=2782, paper_batch=128),
    Recipe("segment", "demo", "configs/segment/demo_deeplabv3_mobilevitv2.yaml", "DeepLabv3-MobileViTv2-0.5",
           "torchvision deeplabv3_mobilenet_v3_large", num_classes=11),
    Recipe("segment", "paper", "configs/segment/ade20k_deeplabv3_mobilevitv2_075.yaml", "DeepLabv3-MobileViTv2-0.75",
           "torchvision deeplabv3_mobilenet_v3_large", num_classes=150, paper_v100=241, paper_batch=32,
           note="ADE20k recipe at width 0.75 (the paper's throughput row), random init"),
    Recipe("translate", "demo", "configs/translate/demo_transformer.yaml", "Transformer 256/2+2", None, tokens=16,
           size_note="512 tokens per side = data.max_tokens"),
    Recipe("translate", "paper", "configs/translate/wmt14_en_de_transformer_base.yaml", "Transformer base",
           "HF MarianMTModel (same dimensions)", tokens=32, size_note="3,104 tokens per side ~ data.max_tokens 3125"),
]


def tiny(recipe: Recipe) -> Recipe:
    """Toy sizes for the CPU smoke run: the same networks, 2 images of 32 px or 2 sentences of 8 tokens
    (and at most 2,000 words of vocabulary: the vocabulary comes from the data, not the architecture)."""
    return dataclasses.replace(recipe, tiny=True, size_note="")


def recipe_layers(path: Path) -> list[dict]:
    """The YAML files a recipe stacks, its ``base:`` chain first (``base: null`` or no ``base``: the chain ends)."""
    import yaml

    layers = []
    while path is not None:
        content = yaml.safe_load(path.read_text())
        layers.insert(0, content)
        base = content.get("base")
        path = (path.parent / base) if base else None
    return layers


def recipe_config(path: Path) -> dict:
    """A recipe's keys after its base chain, merged key by key (enough for the data and trainer sizes;
    the model section goes through the task's parser, see :func:`build_task`)."""
    def merge(into: dict, layer: dict) -> dict:
        for key, value in layer.items():
            into[key] = merge(dict(into.get(key) or {}), value) if isinstance(value, dict) else value
        return into

    merged: dict = {}
    for layer in recipe_layers(path):
        merge(merged, layer)
    return merged


@functools.lru_cache(maxsize=None)
def task_parser(task: str):
    """jsonargparse's parser of ``task``'s class (built once: it inspects every class the arguments name)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    module, name = TASK_CLASSES[task]
    task_class = getattr(importlib.import_module(module), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_class_arguments(task_class, "model", fail_untyped=False, sub_configs=True)
    return parser


def build_task(recipe: Recipe) -> nn.Module:
    """The recipe's task (a LightningModule), built as ``python -m tasks.<task> fit --config <source>``
    builds it: the model sections of the recipe's base chain go through jsonargparse's parser of the
    task class, the data-linked arguments come from :attr:`Recipe.data_links`, and weights start random
    (no ``pretrained`` checkpoint is read)."""
    import yaml

    parser = task_parser(recipe.task)
    layers = [{"model": layer["model"]} for layer in recipe_layers(REPO / recipe.source) if layer.get("model")]
    layers.append({"model": recipe.data_links})
    config = parser.parse_args([arg for layer in layers for arg in ("--config", yaml.safe_dump(layer))])
    backbone = config.model.get("backbone")
    if backbone is not None and backbone.init_args.get("pretrained"):
        backbone.init_args.pretrained = None
    if config.model.get("weights"):
        config.model.weights = None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # (jsonargparse < 4.49)
    return instantiate(config).model


class TimmPeer(nn.Module):
    def __init__(self, name: str, num_classes: int, dropout: float):
        super().__init__()
        import timm

        self.model = timm.create_model(name, pretrained=False, num_classes=num_classes, drop_rate=dropout)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)


class TorchvisionSSDLite(nn.Module):
    """torchvision's SSDLite320-MobileNetV3-Large network (backbone + head), no transform, no loss;
    :meth:`postprocess` is its decoding and NMS."""

    def __init__(self, num_classes: int):
        super().__init__()
        from torchvision.models.detection import ssdlite320_mobilenet_v3_large

        self.model = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes + 1)
        self.backbone, self.head = self.model.backbone, self.model.head
        self._anchors: tuple | None = None

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = list(self.backbone(images).values())
        out = self.head(features)
        if self._anchors is None or self._anchors[0] != images.shape:  # computed once per input shape, as ours
            from torchvision.models.detection.image_list import ImageList

            image_list = ImageList(images, [tuple(images.shape[-2:])] * len(images))
            self._anchors = (images.shape, self.model.anchor_generator(image_list, features))
        return out["cls_logits"], out["bbox_regression"]

    def postprocess(self, outputs, image_size: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
        cls_logits, bbox_regression = outputs
        head = {"cls_logits": cls_logits.float(), "bbox_regression": bbox_regression.float()}
        return self.model.postprocess_detections(head, self._anchors[1], [image_size] * len(cls_logits))


class TorchvisionDeepLab(nn.Module):
    """torchvision's DeepLabv3-MobileNetV3-Large (random weights, no aux head); upsamples to the input itself,
    which :meth:`network` (the logits at the head's resolution) leaves out."""

    def __init__(self, num_classes: int):
        super().__init__()
        from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

        self.model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes,
                                                  aux_loss=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)["out"]

    def network(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.classifier(self.model.backbone(images)["out"])


#: the architecture MarianMTModel has, as our translation task's arguments (recipe values that differ: no peer)
MARIAN_ARCHITECTURE = {"pre_norm": False, "learned_positions": False, "share_embeddings": True,
                       "encoder_attention": "mha"}


class MarianPeer(nn.Module):
    """Hugging Face's ``MarianMTModel`` at our translation model's dimensions, random weights: the same
    architecture as the recipe's Transformer (post-norm blocks, sinusoidal positions scaled embeddings,
    ReLU feed-forward, one embedding shared by encoder, decoder and output projection), SDPA attention."""

    def __init__(self, recipe: Recipe):
        super().__init__()
        from transformers import MarianConfig, MarianMTModel

        from tasks.translate import TranslationTask

        model = recipe.config["model"]  # the recipe's dimensions; special ids as our task's defaults
        ids = {name: parameter.default for name, parameter in inspect.signature(TranslationTask).parameters.items()
               if name in ("pad_id", "bos_id", "eos_id", "label_smoothing")}
        self.pad_id, self.label_smoothing = ids["pad_id"], model.get("label_smoothing", ids["label_smoothing"])
        config = MarianConfig(
            vocab_size=recipe.data_links["vocab_size"], d_model=model["dim"], encoder_layers=model["encoder_depth"],
            decoder_layers=model["decoder_depth"], encoder_attention_heads=model["num_heads"],
            decoder_attention_heads=model["num_heads"], encoder_ffn_dim=model["ffn_dim"],
            decoder_ffn_dim=model["ffn_dim"], activation_function="relu", dropout=model.get("dropout", 0.1),
            attention_dropout=model.get("attention_dropout", 0.0),
            activation_dropout=model.get("activation_dropout", 0.0),
            max_position_embeddings=recipe.data_links["max_positions"], scale_embedding=True,
            pad_token_id=ids["pad_id"], decoder_start_token_id=ids["bos_id"], eos_token_id=ids["eos_id"],
            share_encoder_decoder_embeddings=True, tie_word_embeddings=True, attn_implementation="sdpa")
        self.model = MarianMTModel(config)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        # the synthetic batches hold no padding: no attention mask, as ours takes none then
        return self.model(input_ids=src, decoder_input_ids=tgt_in).logits


def build_network(recipe: Recipe, kind: str) -> nn.Module:
    if kind == "ours":
        return build_task(recipe)
    if recipe.task == "translate":
        return MarianPeer(recipe)
    if recipe.task == "classify":
        dropout = recipe.config["model"].get("head_dropout", 0.0)
        return TimmPeer(recipe.timm, recipe.num_classes, dropout)
    if recipe.task == "detect":
        return TorchvisionSSDLite(recipe.num_classes)
    if recipe.task == "segment":
        return TorchvisionDeepLab(recipe.num_classes)
    raise ValueError(f"{recipe.task} has no peer")


def make_batch(recipe: Recipe, device: torch.device, batch: int | None = None
               ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(network inputs, targets) of one synthetic batch of ``batch`` items (default: the recipe's training
    batch); seeded, so every variant sees the same one."""
    gen = torch.Generator().manual_seed(0)
    b, s = batch or recipe.batch, recipe.size
    if recipe.task == "translate":
        vocab = recipe.data_links["vocab_size"]
        src, tgt_in, tgt_out = (torch.randint(4, vocab, (b, s), generator=gen) for _ in range(3))
        return (src.to(device), tgt_in.to(device)), tgt_out.to(device)
    images = torch.rand(b, 3, s, s, generator=gen).to(device)
    k = recipe.num_classes
    if recipe.task == "classify":
        return (images,), torch.randint(0, k, (b,), generator=gen).to(device)
    if recipe.task == "segment":
        return (images,), torch.randint(0, k, (b, s, s), generator=gen).to(device)
    return (images,), None


def compute_loss(model: nn.Module, recipe: Recipe, outputs, target: torch.Tensor | None) -> torch.Tensor:
    """The task's loss where it needs no more than random targets; stand-ins elsewhere (see ``LOSSES``)."""
    if recipe.task == "detect":
        return sum(o.float().pow(2).mean() for o in outputs[:2])
    if isinstance(outputs, dict):  # a segmentation network: {"out"} (+ "aux" while training)
        if hasattr(model, "losses"):
            return model.losses(outputs, target)["loss"]
        outputs = outputs["out"]
    smoothing = getattr(model, "label_smoothing", 0.0)
    if recipe.task == "translate":
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), target.reshape(-1),
                               ignore_index=model.pad_id, label_smoothing=smoothing)
    return F.cross_entropy(outputs.float(), target, label_smoothing=smoothing)


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """Ours: the recipe's optimizer with the task's parameter groups (its schedule is not stepped:
    constant learning rate); a peer: the same optimizer class and arguments on all its parameters."""
    if hasattr(model, "configure_optimizers"):
        return model.configure_optimizers()["optimizer"]
    optimizer = recipe.config["model"]["optimizer"]
    module, _, name = optimizer["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(model.parameters(), **optimizer.get("init_args", {}))


# --------------------------------------------------------------------------------------------------
# one run: a network x precision x channels_last x compile
# --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    recipe: Recipe
    kind: str                 # "ours" | "peer"
    precision: str
    channels_last: bool
    compile: str              # "off" | "network" | "regional" (--model.compile's values; peers: off | network)

    @property
    def network(self) -> str:
        return self.recipe.network if self.kind == "ours" else self.recipe.peer

    @property
    def deviations(self) -> int:
        """How far from the recipe's own setting (bf16-mixed on GPU, its channels_last)."""
        return int(self.precision != "bf16-mixed") + int(self.channels_last != self.recipe.channels_last)

    def priority(self) -> tuple:
        paper = self.recipe.name == "paper"
        if self.compile == "off":
            tier = {0: 0, 1: 1, 2: 3}[self.deviations]
        elif self.deviations == 0:
            tier = 2 if paper else 4
        else:
            tier = 5 if paper and self.deviations == 1 else 6
        # compiled, per task: ours regional (the quicker compile), then the peer compiled whole, then ours whole
        compiled = {("ours", "regional"): 0, ("peer", "network"): 1, ("ours", "network"): 2}.get(
            (self.kind, self.compile), 0)
        return (tier, RECIPE_NAMES.index(self.recipe.name) * -1, TASKS.index(self.recipe.task),
                PRECISIONS.index(self.precision) if self.precision in PRECISIONS else 9, self.channels_last,
                compiled, self.kind != "ours")

    def order(self) -> tuple:
        return (TASKS.index(self.recipe.task), RECIPE_NAMES.index(self.recipe.name),
                PRECISIONS.index(self.precision) if self.precision in PRECISIONS else 9, COMPILES.index(self.compile),
                self.channels_last, self.kind != "ours")


def base_row(run: Run) -> dict:
    r = run.recipe
    return {
        "task": r.task, "recipe": r.name, "recipe_source": r.source, "kind": run.kind, "network": run.network,
        "batch": r.batch, "size": r.size, "input": r.input, "unit": r.unit, "precision": run.precision,
        "channels_last": run.channels_last, "compile": run.compile, "status": "pending",
        "note": "; ".join(filter(None, [r.note, r.size_note])) if run.kind == "ours" else "",
        "params_m": None, "warmup_steps": 0, "warmup_s": None, "steps": 0, "train_s": None, "train_per_s": None,
        "peak_mem_mb": None, "loss_first": None, "loss_last": None, "loss_curve": [], "infer_per_s": None,
        "infer_batch": None, "postprocess_per_s": None, "seconds": None, "build_s": None, "infer_s": None,
        "paper_v100_infer": r.paper_v100 if run.kind == "ours" else None,
    }


def skip_reason(run: Run, device: torch.device, args) -> str | None:
    if run.precision == "16-mixed" and device.type != "cuda":
        return "16-mixed skipped on CPU (fp16 autocast with GradScaler is a GPU setting)"
    if run.precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16"
    if run.compile != "off" and device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs triton (not installed)"
    if run.compile != "off" and device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler"
    if run.kind == "peer" and run.recipe.task == "classify" and importlib.util.find_spec("timm") is None:
        return "timm not installed (peer)"
    if run.kind == "peer" and run.recipe.task == "translate":
        if importlib.util.find_spec("transformers") is None:
            return "transformers not installed (the peer; pip install -e '.[bench]')"
        model = run.recipe.config["model"]
        differs = {k: model.get(k) for k, marian in MARIAN_ARCHITECTURE.items() if model.get(k, marian) != marian}
        if differs:
            return f"MarianMTModel has no equivalent of the recipe's {differs}"
    elif run.kind == "peer" and importlib.util.find_spec("torchvision") is None:
        return "torchvision not installed (peer)"
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Prepared:
    """A run's network, set up as the task sets it up, with its training step on one fixed batch."""
    model: nn.Module
    step: Callable[[], torch.Tensor]   # one training step; returns the (detached) loss
    dtype: torch.dtype
    params_m: float
    build_s: float


def prepare(run: Run, device: torch.device) -> Prepared:
    """Builds ``run``'s network, optimizer and synthetic batch on ``device`` (seeded: every variant of a recipe
    starts from the same weights and batch)."""
    recipe = run.recipe
    torch.manual_seed(0)
    began = time.perf_counter()
    model = build_network(recipe, run.kind).to(device)
    if run.kind == "ours":  # the task's own set-up: memory format of weights and inputs, compilation
        model.channels_last, model.compile_mode = run.channels_last, None if run.compile == "off" else run.compile
        model.configure_model()
    else:
        if run.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if run.compile != "off":
            model.compile()
    optimizer = make_optimizer(model, recipe)
    inputs, target = make_batch(recipe, device)
    if run.channels_last:
        inputs = tuple(x.contiguous(memory_format=torch.channels_last) for x in inputs)
    dtype = torch.bfloat16 if run.precision == "bf16-mixed" else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=run.precision == "16-mixed")
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = compute_loss(model, recipe, model(*inputs), target)
        scaler.scale(loss).backward()
        if recipe.clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    model.train()
    return Prepared(model, step, dtype, params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
                    build_s=round(time.perf_counter() - began, 2))


def warmup_steps(run: Run, args) -> int:
    # compiled SSDLite recompiles once, on its second call (the anchor cache is filled on the first)
    return max(args.warmup, 2) if run.compile != "off" else args.warmup


def measure(run: Run, args, device: torch.device) -> dict:
    row = base_row(run)
    reason = skip_reason(run, device, args)
    if reason:
        row.update(status="skipped", note=reason)
        return row
    recipe = run.recipe
    try:
        prepared = prepare(run, device)
        model, step, dtype = prepared.model, prepared.step, prepared.dtype
        row.update(params_m=prepared.params_m, build_s=prepared.build_s)
        losses = []
        warmup = warmup_steps(run, args)
        sync(device)
        start = time.perf_counter()
        for _ in range(warmup):
            losses.append(step())
        sync(device)
        row.update(warmup_steps=warmup, warmup_s=round(time.perf_counter() - start, 3))

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        start = time.perf_counter()
        steps = 0
        while steps < args.steps:
            losses.append(step())
            steps += 1
            if args.max_run_seconds and time.perf_counter() - start > args.max_run_seconds:
                break
        sync(device)
        seconds = time.perf_counter() - start
        curve = torch.stack(losses).float().cpu()
        row.update(steps=steps, train_s=round(seconds, 4), train_per_s=steps * recipe.items_per_step / seconds,
                   loss_first=float(curve[0]), loss_last=float(curve[-1]),
                   loss_curve=[round(float(v), 5) for v in curve[:: max(1, math.ceil(len(curve) / 20))]])
        if device.type == "cuda":
            row["peak_mem_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if steps < args.steps:
            row["note"] = "; ".join(filter(None, [row["note"], f"timing stopped after {args.max_run_seconds:g} s"]))
        if not all(math.isfinite(v) for v in (row["loss_first"], row["loss_last"])):
            row["note"] = "; ".join(filter(None, [row["note"], "non-finite loss"]))

        del losses, prepared, step  # the step holds the training batch
        if recipe.times_inference and (run.compile == "off" or args.infer_compiled):
            began = time.perf_counter()
            row.update(infer_rates(model, run, dtype, args, device))
            row["infer_s"] = round(time.perf_counter() - began, 2)
        elif recipe.times_inference:
            row["note"] = "; ".join(filter(None, [row["note"], "inference: eager rows only (--infer-compiled)"]))
        row["status"] = "ok"
    except Exception as error:
        traceback.print_exc()
        row.update(status="error", note=f"{type(error).__name__}: {error}".replace("\n", " ")[:400])
    return row


def release(device: torch.device) -> None:
    """Free what the last run left (called once its frame, model and optimizer are gone)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch.compiler.reset()


def network_only(model: nn.Module, run: Run):
    """The part of the network the paper's throughput counts: segmentation stops at the head's logits
    (the upsampling to the input is postprocessing); the others are their forward."""
    if run.recipe.task != "segment":
        return model
    if run.kind == "peer":
        return model.network
    return lambda images: model.head(model.backbone(model.to_memory_format(images)))["out"]


def postprocess(model: nn.Module, run: Run):
    """What turns the network's outputs into predictions (None: nothing to time)."""
    size = (run.recipe.size, run.recipe.size)
    if run.recipe.task == "detect":
        if run.kind == "peer":
            return lambda outputs: model.postprocess(outputs, size)
        return lambda outputs: model.head.postprocess(outputs, size)
    if run.recipe.task == "segment":
        return lambda logits: F.interpolate(logits, size=size, mode="bilinear", align_corners=False).argmax(1)
    return None


def timed_rate(fn, warmup: int, steps: int, device: torch.device) -> float:
    """Calls per second of ``fn()`` over ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return steps / (time.perf_counter() - start)


def infer_rates(model: nn.Module, run: Run, dtype, args, device: torch.device) -> dict:
    """Inference at the paper's protocol: items per second of the network alone and of its postprocessing,
    at the recipe's inference batch, in eval mode, no grad, the row's autocast."""
    recipe = run.recipe
    inputs, _ = make_batch(recipe, device, recipe.infer_batch)
    if run.channels_last:
        inputs = tuple(x.contiguous(memory_format=torch.channels_last) for x in inputs)
    network, finish = network_only(model, run), postprocess(model, run)
    items = recipe.infer_batch * (recipe.size if recipe.task == "translate" else 1)
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            rate = timed_rate(lambda: network(*inputs), args.infer_warmup, args.infer_steps, device)
            result = {"infer_per_s": rate * items, "infer_batch": recipe.infer_batch, "postprocess_per_s": None}
            if finish is not None:
                outputs = network(*inputs)
                rate = timed_rate(lambda: finish(outputs), args.postprocess_warmup, args.postprocess_steps, device)
                result["postprocess_per_s"] = rate * items
    finally:
        model.train()
    return result


# --------------------------------------------------------------------------------------------------
# interleaved rounds: ours against the peer, and the variants a recipe chooses between
# --------------------------------------------------------------------------------------------------
@dataclass
class Group:
    """Runs of one recipe timed in interleaved rounds (:mod:`interleaved`); the first is the reference each round's
    ratios divide by. ``pair``: [peer, ours] at the recipe's settings, eager; ``decision``: [the recipe's own
    channels_last and compile, the other variants of ours]."""
    kind: str                 # "pair" | "decision"
    runs: list[Run]

    @property
    def recipe(self) -> Recipe:
        return self.runs[0].recipe


def interleaved_plan(args) -> list[Group]:
    """The pairs first (each paper recipe's headline: ours against its peer), then the decision groups."""
    precision = "bf16-mixed" if "bf16-mixed" in args.precisions else args.precisions[0]
    pairs, decisions = [], []
    for recipe in RECIPES:
        if recipe.task not in args.tasks or recipe.name != "paper" or "paper" not in args.recipes:
            continue
        recipe = tiny(recipe) if args.tiny else recipe
        current = (recipe.channels_last, recipe.compile)
        if "pairs" in args.interleaved and recipe.peer and args.peers != "none":
            pairs.append(Group("pair", [Run(recipe, kind, precision, recipe.channels_last, "off")
                                        for kind in ("peer", "ours")]))
        if "decide" in args.interleaved:
            layouts = [False] if recipe.task == "translate" else [False, True]
            variants = [current] + [(cl, c) for cl in layouts for c in args.compile if (cl, c) != current]
            if len(variants) > 1:  # (translation with --compile off: nothing to decide between)
                decisions.append(Group("decision", [Run(recipe, "ours", precision, cl, c) for cl, c in variants]))
    return pairs + decisions


def measure_group(group: Group, args, device: torch.device) -> list[dict]:
    """One row per run of ``group``: built, warmed up, then ``args.rounds`` interleaved rounds of
    ``args.round_steps`` training steps each. ``train_per_s`` is the median of the rounds' rates; ``ratio`` summarises
    the rounds' rate over the reference's rate in the same round (:func:`interleaved.spread`)."""
    from interleaved import spread, timed_rounds

    rows, prepared = [base_row(run) for run in group.runs], {}
    reference = skip_reason(group.runs[0], device, args)
    if reference:  # nothing to compare with: nothing is built
        rows[0].update(status="skipped", note=reference)
        for row in rows[1:]:
            row.update(status="skipped", note=f"not compared: the reference ({rows[0]['network']}) is skipped")
        return rows
    for i, (run, row) in enumerate(zip(group.runs, rows)):
        reason = skip_reason(run, device, args)
        if reason:
            row.update(status="skipped", note=reason)
            continue
        began = time.perf_counter()
        try:
            prepared[i] = prepare(run, device)
            row.update(params_m=prepared[i].params_m, build_s=prepared[i].build_s)
            warmup = warmup_steps(run, args)
            start = time.perf_counter()
            loss = [prepared[i].step() for _ in range(warmup)][-1]
            row.update(warmup_steps=warmup, warmup_s=round(time.perf_counter() - start, 3), loss_first=float(loss))
        except Exception as error:
            traceback.print_exc()
            prepared.pop(i, None)
            row.update(status="error", note=f"{type(error).__name__}: {error}".replace("\n", " ")[:400])
        row["seconds"] = round(time.perf_counter() - began, 1)
    if 0 not in prepared or len(prepared) < 2:
        why = f"the reference ({rows[0]['network']}) did not run" if 0 not in prepared else "no other variant ran"
        for i in prepared:
            rows[i].update(status="skipped", note=f"not compared: {why}")
        return rows
    began = time.perf_counter()
    try:
        seconds, orders = timed_rounds({i: p.step for i, p in prepared.items()}, args.rounds, args.round_steps,
                                       device)
    except Exception as error:
        traceback.print_exc()
        for i in prepared:
            rows[i].update(status="error", note=f"{type(error).__name__}: {error}".replace("\n", " ")[:400])
        return rows
    items = group.recipe.items_per_step * args.round_steps
    rates = {i: [items / s for s in per_round] for i, per_round in seconds.items()}
    timed_s = (time.perf_counter() - began) / len(prepared)
    for i, per_round in rates.items():
        ratios = [rate / reference for rate, reference in zip(per_round, rates[0])]
        rows[i].update(status="ok", rounds=args.rounds, round_steps=args.round_steps, steps=args.rounds * args.round_steps,
                       train_per_s=statistics.median(per_round), round_per_s=per_round, ratios=ratios,
                       ratio=spread(ratios), first_in_round=[order.index(i) == 0 for order in orders],
                       seconds=round(rows[i]["seconds"] + timed_s, 1))
    return rows


def decide(rows: list[dict], current: tuple[bool, str]) -> dict:
    """The ``model.channels_last`` and ``model.compile`` a recipe should take, from its decision group's rows
    (each with ``channels_last``, ``compile``, ``status`` and, if ok, ``ratio``: the rounds' rate over the recipe's
    own setting ``current``, summarised by :func:`interleaved.spread`).

    Rule: an alternative replaces the recipe's setting only if it was faster in every round (its smallest round
    ratio > 1: the margin exceeds the spread below the median); of those, the one with the highest median. An
    axis's value is ``None`` (not measured) where the recipe's own setting did not run or no alternative that
    changes that axis did; ``margin`` is the chosen alternative's median ratio - 1, or, where the setting stays,
    the fastest alternative's."""
    by_variant = {(r["channels_last"], r["compile"]): r for r in rows}
    base = by_variant.get(current)
    label = lambda v: f"channels_last {'on' if v[0] else 'off'}, compile {v[1]}"  # noqa: E731
    unmeasured = [f"{label(v)} ({r['status']}: {r['note'] or '-'})" for v, r in by_variant.items()
                  if v != current and r["status"] != "ok"]
    decision = {"current": {"channels_last": current[0], "compile": current[1]}, "channels_last": None,
                "compile": None, "change": False, "margin": None, "chosen": None, "not_measured": unmeasured}
    if base is None or base["status"] != "ok":
        decision["evidence"] = f"not measured: the recipe's own setting ({label(current)}) did not run"
        return decision
    measured = {v: r["ratio"] for v, r in by_variant.items() if v != current and r["status"] == "ok"}
    if not measured:
        decision["evidence"] = "not measured: no alternative to the recipe's own setting ran"
        return decision
    resolved = [v for v in measured if measured[v]["min"] > 1.0]
    shown = max(resolved or measured, key=lambda v: measured[v]["median"])
    chosen = shown if resolved else current
    ratio = measured[shown]
    decision.update(change=bool(resolved), margin=ratio["median"] - 1.0, chosen=list(chosen),
                    evidence=f"{base['rounds']} rounds x {base['round_steps']} steps; "
                             f"{'chosen' if resolved else 'fastest'} alternative {label(shown)}: "
                             f"x{ratio['median']:.3f} (rounds {ratio['min']:.3f}-{ratio['max']:.3f})")
    for axis, index in (("channels_last", 0), ("compile", 1)):
        if any(v[index] != current[index] for v in measured):
            decision[axis] = chosen[index]
    return decision


def decisions(groups: list[dict]) -> list[dict]:
    """:func:`decide` for every measured decision group (``groups``: the JSON's ``interleaved`` list)."""
    out = []
    for group in groups:
        if group["kind"] != "decision":
            continue
        current = (group["current"]["channels_last"], group["current"]["compile"])
        out.append({"task": group["task"], "recipe_source": group["recipe_source"], **decide(group["rows"], current)})
    return out


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------
def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.1f}"
    return f"{value:.{digits}g}"


def peer_ratio(row: dict, rows: list[dict]) -> float | None:
    if row["kind"] != "ours" or row["status"] != "ok":
        return None
    # the peers compile whole: our regional rows are compared with the peer's compiled row
    compiled = "off" if row["compile"] == "off" else "network"
    for other in rows:
        if (other["kind"] == "peer" and other["status"] == "ok" and other["compile"] == compiled
                and all(other[k] == row[k] for k in ("task", "recipe", "precision", "channels_last"))):
            return row["train_per_s"] / other["train_per_s"]
    return None


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# GPU suite",
        "",
        f"`{meta['command']}`",
        "",
        f"- machine: {meta['device_name']}; torch {meta['torch']}"
        + (f", CUDA {meta['cuda']}, cudnn.benchmark {meta['cudnn_benchmark']}" if meta["device"] != "cpu" else "")
        + f"; {meta['started']}; wall time {meta['wall_s']:.0f} s",
        f"- measured: {MEASURED}",
        f"- loss: {LOSSES}",
        f"- steps: {meta['warmup']} untimed warm-up steps (they include compilation), then up to {meta['steps']} "
        f"timed ones" + (f", timing stopped after {meta['max_run_seconds']:g} s" if meta["max_run_seconds"] else "")
        + f"; time budget: {str(meta['budget_s']) + ' s' if meta['budget_s'] else 'none'}",
        f"- infer: the network alone at the paper's protocol (inference batch in the column, "
        f"{meta['infer_warmup']} warm-up then {meta['infer_steps']} timed batches), eval mode, no grad, the row's "
        "autocast; segmentation up to the head's logits; *postprocess*: decoding + NMS (detection) or upsampling "
        f"to the input + argmax (segmentation) of those outputs ({meta['postprocess_warmup']} warm-up, "
        f"{meta['postprocess_steps']} timed); *paper V100*: MobileViTv2 paper's throughput for that network "
        "(measured on a V100; compare with the infer column, not train)",
        "- ours/peer: training throughput ratio against the peer row of the same variant (> 1: ours faster)",
    ]
    lines += [
        "",
        "| task | recipe | network | params M | batch x input | precision | ch.last | compile | steps "
        "| train | peak GPU MB | loss first → last | infer batch | infer | postprocess | paper V100 infer | ours/peer "
        "| s | note |",
        "| --- | --- | --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- |",
    ]
    for row in rows:
        ok = row["status"] == "ok"
        unit = row["unit"]
        ratio = peer_ratio(row, rows)
        loss = f"{row['loss_first']:.4g} → {row['loss_last']:.4g}" if ok else "-"
        note = {"error": f"**error**: {row['note']}", "pending": "not run (interrupted?)"}.get(row["status"],
                                                                                           row["note"])
        lines.append(
            f"| {row['task']} | {row['recipe']} | {row['network']} | {fmt(row['params_m'])} | {row['input']} "
            f"| {row['precision']} | {'on' if row['channels_last'] else 'off'} | {row['compile']} "
            f"| {row['steps'] if ok else '-'} | {fmt(row['train_per_s']) + ' ' + unit if ok else '-'} "
            f"| {fmt(row['peak_mem_mb'])} "
            f"| {loss} "
            f"| {row['infer_batch'] or '-'} | {fmt(row['infer_per_s']) + ' ' + unit if row['infer_per_s'] else '-'} "
            f"| {fmt(row['postprocess_per_s']) + ' ' + unit if row['postprocess_per_s'] else '-'} "
            f"| {fmt(row['paper_v100_infer'])} "
            f"| {'-' if ratio is None else f'{ratio:.2f}'} | {fmt(row['seconds'])} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def variant_label(row: dict) -> str:
    return f"{row['network']} (ch.last {'on' if row['channels_last'] else 'off'}, compile {row['compile']})"


def ratio_cell(row: dict) -> tuple[str, str]:
    """(median ratio, 'min-max (IQR q1-q3)') of a row timed in interleaved rounds; '-' where it did not run."""
    if row["status"] != "ok":
        return "-", "-"
    r = row["ratio"]
    return f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f} (IQR {r['q1']:.3f}-{r['q3']:.3f})"


HOW_TO_READ = ("How to read: each round times every variant for the same number of training steps, one after the "
               "other (the order rotates each round: two variants alternate which goes first), each timing between "
               "two CUDA events (on a CPU: the host clock). A ratio is taken within one round, so a slow moment of "
               "the machine hits both sides; the median over the rounds is the result and the spread (smallest to "
               "largest round ratio, interquartile range in brackets) is how far single rounds strayed from it: a "
               "difference smaller than the spread is not resolved by this run.")
DECISION_RULE = ("Rule: a recipe's value changes only if the fastest measured alternative beat the recipe's own setting "
                 "in every round (its smallest round ratio > 1, i.e. the margin exceeds the spread below the median); "
                 "*not measured* where the recipe's own setting or every alternative on that axis did not run.")


def markdown_interleaved(records: list[dict], meta: dict) -> str:
    """The interleaved pairs, the decision per paper network and its variants, as Markdown."""
    if not records:
        return ""
    steps = f"{meta['rounds']} rounds x {meta['round_steps']} steps"
    lines = ["", "## Ours against the peer, interleaved rounds", "",
             f"Each paper recipe's network against its peer, eager, {steps}; the recipe's channels_last. "
             + HOW_TO_READ, "",
             "| task | ours | peer | precision | ch.last | rounds x steps | ours (median) | peer (median) "
             "| ours/peer (median) | spread of the round ratios | note |",
             "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for record in (r for r in records if r["kind"] == "pair"):
        peer, ours = record["rows"]
        ok = ours["status"] == "ok"
        rounds = f"{ours['rounds']} x {ours['round_steps']}" if ok else "-"
        median, spread_text = ratio_cell(ours)
        note = "; ".join(f"{row['kind']}: {row['status']}: {row['note']}" for row in (peer, ours)
                         if row["status"] != "ok")
        lines.append(f"| {record['task']} | {ours['network']} | {peer['network']} | {ours['precision']} "
                     f"| {'on' if ours['channels_last'] else 'off'} "
                     f"| {rounds} "
                     f"| {fmt(ours['train_per_s']) + ' ' + ours['unit'] if ok else '-'} "
                     f"| {fmt(peer['train_per_s']) + ' ' + peer['unit'] if ok else '-'} "
                     f"| {median} | {spread_text} | {note.replace('|', '/')} |")
    lines += ["", "## model.channels_last and model.compile per paper network", "",
              f"The variants of each paper recipe's network ({steps}, bf16-mixed unless the command says otherwise) "
              "against the recipe's own setting. " + DECISION_RULE
              + (" **Measured on a CPU: these values say nothing about a GPU.**" if meta.get("device") == "cpu" else ""),
              "",
              "| recipe | channels_last | compile | margin over the recipe's current setting | evidence (rounds, spread) |",
              "| --- | --- | --- | ---: | --- |"]
    for decision in decisions(records):
        def value(axis: str) -> str:
            """The recipe's value as YAML writes it, bold where it changes."""
            if decision[axis] is None:
                return "not measured"
            yaml_value = lambda v: str(v).lower() if isinstance(v, bool) else "false" if v == "off" else v  # noqa: E731
            if decision[axis] == decision["current"][axis]:
                return f"{yaml_value(decision[axis])} (keep)"
            return f"**{yaml_value(decision[axis])}** (was {yaml_value(decision['current'][axis])})"
        margin = "-" if decision["margin"] is None else f"{decision['margin'] * 100:+.1f} %"
        evidence = decision["evidence"] + (f"; not measured: {'; '.join(decision['not_measured'])}"
                                           if decision["not_measured"] else "")
        lines.append(f"| {decision['recipe_source']} | {value('channels_last')} | {value('compile')} | {margin} "
                     f"| {evidence.replace('|', '/')} |")
    lines += ["", "| task | variant | rate (median) | over the recipe's setting (median) | spread | note |",
              "| --- | --- | ---: | ---: | --- | --- |"]
    for record in (r for r in records if r["kind"] == "decision"):
        for row in record["rows"]:
            median, spread_text = ratio_cell(row)
            rate = fmt(row["train_per_s"]) + " " + row["unit"] if row["status"] == "ok" else "-"
            note = "" if row["status"] == "ok" else f"{row['status']}: {row['note']}"
            lines.append(f"| {record['task']} | {variant_label(row)} | {rate} | {median} | {spread_text} "
                         f"| {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n\n"


def write_outputs(output: Path, rows: list[dict], meta: dict, interleaved: list[dict] | None = None) -> None:
    interleaved = interleaved or []
    output.mkdir(parents=True, exist_ok=True)
    (output / "gpu_suite.json").write_text(json.dumps(
        {"meta": meta, "interleaved": interleaved, "decisions": decisions(interleaved), "rows": rows}, indent=1))
    table = markdown(rows, meta)
    head, _, body = table.partition("\n| task |")  # the interleaved sections after the settings, before the table
    (output / "gpu_suite.md").write_text(head + markdown_interleaved(interleaved, meta)
                                         + ("## Single-window runs\n\n| task |" + body if body else ""))


# --------------------------------------------------------------------------------------------------
# environment check
# --------------------------------------------------------------------------------------------------
def check_env() -> int:
    def version(name: str) -> str | None:
        if importlib.util.find_spec(name) is None:
            return None
        try:
            return getattr(importlib.import_module(name), "__version__", "installed")
        except Exception as error:
            return f"broken ({type(error).__name__}: {error})"

    needed = {"torch": "everything", "yaml": "reading the recipes (PyYAML)",
              "jsonargparse": "building each task from its recipe, as the CLIs do"}
    optional = {
        "torchvision": "detection and segmentation peers",
        "timm": "classification peer (mobilevitv2_050/100)",
        "triton": "compiled rows on CUDA (torch.compile's GPU backend)",
    }
    missing_needed, missing_optional = [], []
    print("package       version          used for")
    for table, missing in ((needed, missing_needed), (optional, missing_optional)):
        for name, use in table.items():
            v = version(name)
            print(f"{name:<13} {v or 'MISSING':<16} {use}")
            if v is None:
                missing.append(name)
    compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    print(f"{'C++ compiler':<13} {compiler or 'MISSING':<16} compiled rows on CPU (--tiny --compile on)")
    if compiler is None:
        missing_optional.append("a C++ compiler")
    if torch.cuda.is_available():
        print(f"CUDA: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
              f"CUDA {torch.version.cuda}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'NO'}")
    else:
        print(f"CUDA: not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
              "only --tiny runs here")
    print(f"missing optional: {', '.join(missing_optional) if missing_optional else 'none'}")
    if missing_needed:
        print(f"missing required: {', '.join(missing_needed)}")
    return 1 if missing_needed else 0


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------
class Budget:
    """Whether a run may start: one whose estimated end lies past the budget is skipped; eager runs may use
    only ``1 - compiled_share`` of it when compiled runs are planned, so those keep their place. A run's
    estimate is the mean wall seconds of the runs of its kind (eager, compiled) so far; the first guesses
    are the first GPU run's: ~23 s per eager run (the row's steps plus its model build and cuDNN's
    algorithm search), a compiled run ~25 s more for compilation."""

    FIRST_GUESS = {"eager": 23.0, "compiled": 48.0}

    def __init__(self, budget_s: float, compiled_share: float, any_compiled: bool,
                 first_guess: dict[str, float] | None = None):
        self.budget_s = budget_s
        self.first_guess = first_guess or self.FIRST_GUESS
        self.eager_s = budget_s * (1 - compiled_share) if any_compiled else budget_s
        self.seen: dict[str, list[float]] = {"eager": [], "compiled": []}

    @staticmethod
    def kind(run: Run) -> str:
        return "eager" if run.compile == "off" else "compiled"

    def estimate(self, run: Run) -> float:
        seen = self.seen[self.kind(run)]
        return sum(seen) / len(seen) if seen else self.first_guess[self.kind(run)]

    def refuses(self, run: Run, elapsed: float) -> str | None:
        if not self.budget_s:
            return None
        limit = self.eager_s if self.kind(run) == "eager" else self.budget_s
        if elapsed + self.estimate(run) <= limit:
            return None
        share = " (the eager runs' share)" if limit < self.budget_s else ""
        return f"time budget (--budget-s {self.budget_s:g}{share}: ~{self.estimate(run):.0f} s more would end past it)"

    def record(self, run: Run, seconds: float) -> None:
        self.seen[self.kind(run)].append(seconds)


#: seconds per variant of an interleaved group before any was measured: build, warm-up and its share of 7 rounds
#: of 5 steps (~8 s eager on the first GPU run's sizes); a compiled variant adds its compilation (~25-40 s)
INTERLEAVED_FIRST_GUESS = {"eager": 8.0, "compiled": 45.0}


def affordable(group: Group, budget: Budget, elapsed: float) -> tuple[list[Run], str | None]:
    """The runs of ``group`` that may start at ``elapsed`` seconds: all, else its eager ones (the compiled
    variants are dropped first), else none; and why some were dropped."""
    eager = [run for run in group.runs if run.compile == "off"]
    for runs in (group.runs, eager if group.runs[0].compile == "off" else []):
        if len(runs) >= 2 and (not budget.budget_s
                               or elapsed + sum(budget.estimate(run) for run in runs) <= budget.budget_s):
            return runs, None if len(runs) == len(group.runs) else "the compiled variants"
    return [], "the group (or its eager variants alone)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: toy sizes, 1 warm-up + 2 timed steps")
    p.add_argument("--check-env", action="store_true", help="print missing optional packages and exit")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--recipes", nargs="+", choices=RECIPE_NAMES, default=list(RECIPE_NAMES))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--channels-last", nargs="+", choices=["off", "on", "recipe"], default=None,
                   help="image tasks only (translation runs without); 'recipe': the recipe's own setting "
                        "(on for the paper recipes, off for the demos). Default: off on (GPU), recipe (--tiny)")
    p.add_argument("--compile", nargs="+", choices=["off", "on", *COMPILES[1:]], default=None,
                   help="--model.compile's values ('on' = network: each sub-network whole; regional: the repeated "
                        "blocks; peers are compiled whole); default: off network regional (GPU), off (--tiny)")
    p.add_argument("--peers", choices=["paper", "all", "none"], default="paper",
                   help="run the peers at the paper recipes' sizes (default), at every recipe's, or not at all")
    p.add_argument("--steps", type=int, default=None, help="timed training steps per run (default 200; --tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 10; --tiny 1)")
    p.add_argument("--max-run-seconds", type=float, default=None,
                   help="stop a run's timing after this many seconds (default 4; --tiny: no limit; 0: none)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run that would end past this many seconds (default 420; --tiny: none; 0: none)")
    p.add_argument("--infer-steps", type=int, default=None, help="timed inference batches (default 50, the "
                                                                  "paper's; --tiny 1)")
    p.add_argument("--infer-warmup", type=int, default=None, help="untimed inference batches (default 10; --tiny 1)")
    p.add_argument("--compiled-share", type=float, default=0.4,
                   help="share of --budget-s kept for compiled runs when any are planned (eager runs use the rest)")
    p.add_argument("--infer-compiled", action="store_true",
                   help="also time inference in compiled rows (recompiles each network for eval mode)")
    p.add_argument("--interleaved", nargs="*", choices=["pairs", "decide"], default=["pairs", "decide"],
                   help="interleaved rounds before the single-window runs: 'pairs' each paper recipe's network "
                        "against its peer, 'decide' its channels_last x --compile variants against the recipe's "
                        "own setting (nothing: none)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; --tiny 3)")
    p.add_argument("--round-steps", type=int, default=None,
                   help="training steps per variant and round (default 5; --tiny 1)")
    p.add_argument("--interleaved-budget-s", type=float, default=None,
                   help="start no interleaved group that would end past this many seconds (compiled variants "
                        "dropped first; default half of --budget-s; 0: none)")
    p.add_argument("--interleaved-only", action="store_true", help="skip the single-window runs")
    p.add_argument("--device", default=None, help="default: cuda if available; --tiny: cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU; --tiny default 1)")
    p.add_argument("--no-cudnn-benchmark", action="store_true")
    p.add_argument("--output", type=Path, default=None,
                   help=f"default {DEFAULT_OUTPUT.relative_to(REPO)}/ (--tiny: its tiny/ folder)")
    args = p.parse_args(argv)
    gpu_defaults = dict(channels_last=["off", "on"], compile=list(COMPILES), steps=200, warmup=10, rounds=7,
                        round_steps=5,
                        max_run_seconds=2.0, budget_s=420.0, infer_steps=50, infer_warmup=10, output=DEFAULT_OUTPUT)
    tiny_defaults = dict(channels_last=["recipe"], compile=["off"], steps=2, warmup=1, rounds=3, round_steps=1,
                         max_run_seconds=0.0,
                         budget_s=0.0, infer_steps=1, infer_warmup=1,
                         output=DEFAULT_OUTPUT / "tiny")
    for key, value in (tiny_defaults if args.tiny else gpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.postprocess_warmup, args.postprocess_steps = (1, 1) if args.tiny else (2, 10)
    if args.interleaved_budget_s is None:
        args.interleaved_budget_s = args.budget_s / 2
    if args.rounds < 1 or args.round_steps < 1:
        p.error(f"--rounds and --round-steps must be at least 1, got {args.rounds} and {args.round_steps}")
    args.compile = sorted({"network" if v == "on" else v for v in args.compile}, key=COMPILES.index)
    return args


def plan(args) -> list[Run]:
    runs = []
    for recipe in RECIPES:
        if recipe.task not in args.tasks or recipe.name not in args.recipes:
            continue
        if args.tiny:
            recipe = tiny(recipe)
        kinds = ["ours"]
        if recipe.peer and (args.peers == "all" or (args.peers == "paper" and recipe.name == "paper")):
            kinds.append("peer")
        layouts = sorted({recipe.channels_last if v == "recipe" else v == "on" for v in args.channels_last})
        if recipe.task == "translate":
            layouts = [False]
        for precision in args.precisions:
            for channels_last in layouts:
                for compiled in args.compile:
                    for kind in kinds:
                        if not (kind == "peer" and compiled == "regional"):
                            runs.append(Run(recipe, kind, precision, channels_last, compiled))
    return runs


def run_interleaved(groups: list[Group], args, device: torch.device, start: float, meta: dict,
                    single_rows: Callable[[], list[dict]]) -> list[dict]:
    """Times ``groups`` in order, within ``--interleaved-budget-s`` (:func:`affordable`), rewriting the files after
    each; returns one record per group: its recipe, the recipe's own setting and a row per run (its order)."""
    budget = Budget(args.interleaved_budget_s, 0.0, False, first_guess=INTERLEAVED_FIRST_GUESS)
    records = []
    for number, group in enumerate(groups, 1):
        runs, dropped = affordable(group, budget, time.perf_counter() - start)
        measured = measure_group(Group(group.kind, runs), args, device) if runs else []
        release(device)
        by_run = {id(run): row for run, row in zip(runs, measured)}
        rows = []
        for run in group.runs:
            row = by_run.get(id(run))
            if row is None:
                row = base_row(run)
                row.update(status="skipped", note=f"time budget (--interleaved-budget-s {args.interleaved_budget_s:g}: "
                                                  f"{dropped} would end past it)")
            elif row["status"] == "ok":
                budget.record(run, row["seconds"])
            rows.append(row)
        recipe = group.recipe
        records.append({"kind": group.kind, "task": recipe.task, "recipe": recipe.name, "recipe_source": recipe.source,
                        "network": recipe.network, "peer": recipe.peer if group.kind == "pair" else None,
                        "current": {"channels_last": recipe.channels_last, "compile": recipe.compile}, "rows": rows})
        for row in rows[1:]:
            ratio = f"x{row['ratio']['median']:.3f} (rounds {row['ratio']['min']:.3f}-{row['ratio']['max']:.3f})" \
                if row["status"] == "ok" else f"{row['status']}: {row['note']}"
            print(f"[interleaved {number}/{len(groups)} {time.perf_counter() - start:5.0f}s] {recipe.task} "
                  f"{group.kind}: {variant_label(row)} over {variant_label(rows[0])}: {ratio}", flush=True)
        meta["wall_s"] = round(time.perf_counter() - start, 1)
        write_outputs(args.output, single_rows(), meta, records)
    return records


def main(argv=None) -> int:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    args = parse_args(argv)
    if args.check_env:
        return check_env()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    if device.type == "cpu" and not args.tiny and not args.device:
        print("no CUDA device: full-size runs would take hours on CPU. Use --tiny (or --device cpu to insist).",
              file=sys.stderr)
        return 2
    if args.threads or args.tiny:
        # one thread for the smoke run: on a shared 2-core machine OpenMP's spinning made 2 threads 10x slower
        torch.set_num_threads(args.threads or 1)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not args.no_cudnn_benchmark

    runs = [] if args.interleaved_only else plan(args)
    groups = interleaved_plan(args)
    meta = {
        "command": "python benchmarks/gpu_suite.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark) if device.type == "cuda" else None,
        "steps": args.steps, "warmup": args.warmup, "max_run_seconds": args.max_run_seconds,
        "infer_warmup": args.infer_warmup, "infer_steps": args.infer_steps, "compiled_share": args.compiled_share,
        "postprocess_warmup": args.postprocess_warmup, "postprocess_steps": args.postprocess_steps,
        "budget_s": args.budget_s, "tiny": args.tiny, "measured": MEASURED, "loss": LOSSES,
        "rounds": args.rounds, "round_steps": args.round_steps, "interleaved_budget_s": args.interleaved_budget_s,
        "recipes": {f"{r.task} {r.name}": r.source for r in RECIPES}, "wall_s": 0.0,
    }
    print(f"{len(groups)} interleaved groups and {len(runs)} runs on {meta['device_name']}; output {args.output}",
          flush=True)
    rows: dict[int, dict] = {id(run): base_row(run) for run in runs}
    start = time.perf_counter()
    records = run_interleaved(groups, args, device, start, meta, lambda: [rows[id(r)] for r in runs])
    budget = Budget(args.budget_s, args.compiled_share, any(run.compile != "off" for run in runs))
    for i, run in enumerate(sorted(runs, key=Run.priority), 1):
        refused = budget.refuses(run, time.perf_counter() - start)
        if refused:
            row = base_row(run)
            row.update(status="skipped", note=refused)
        else:
            began = time.perf_counter()
            row = measure(run, args, device)
            release(device)
            if row["status"] != "skipped":
                row["seconds"] = round(time.perf_counter() - began, 1)
            if row["status"] == "ok":
                budget.record(run, row["seconds"])
        rows[id(run)] = row
        what = f"{run.recipe.task} {run.recipe.name} {run.network} {run.precision} " \
               f"cl={'on' if run.channels_last else 'off'} compile={run.compile}"
        if row["status"] == "ok":
            result = (f"{fmt(row['train_per_s'])} {row['unit']} ({row['steps']} steps), peak "
                      f"{fmt(row['peak_mem_mb'])} MB, loss {row['loss_first']:.4g} -> {row['loss_last']:.4g}"
                      + (f", infer {fmt(row['infer_per_s'])} {row['unit']} at batch {row['infer_batch']}"
                         if row["infer_per_s"] else "")
                      + (f", postprocess {fmt(row['postprocess_per_s'])} {row['unit']}" if row["postprocess_per_s"]
                         else "") + f"; {row['seconds']} s")
        else:
            result = f"{row['status']}: {row['note']}"
        print(f"[{i}/{len(runs)} {time.perf_counter() - start:5.0f}s] {what}: {result}", flush=True)
        meta["wall_s"] = round(time.perf_counter() - start, 1)
        ordered = [rows[id(r)] for r in sorted(runs, key=Run.order)]
        write_outputs(args.output, ordered, meta, records)
    if not runs:
        write_outputs(args.output, [], meta, records)
    every_row = [*rows.values(), *(row for record in records for row in record["rows"])]
    counts = {s: sum(r["status"] == s for r in every_row) for s in ("ok", "skipped", "error")}
    print(f"done in {meta['wall_s']:.0f} s: {counts['ok']} ok, {counts['skipped']} skipped, {counts['error']} errors; "
          f"{args.output / 'gpu_suite.md'}, {args.output / 'gpu_suite.json'}")
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
