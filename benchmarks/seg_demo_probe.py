"""Where the segmentation demo's time goes: learning *which* digit a stroke is, not *where* strokes are.

A plain training loop (no Lightning, one process, ``--threads`` torch threads) over the demo's
own datamodule and model classes, with the demo recipe's values for everything not given as an
option, printing on the 100 validation scenes every ``--eval-every`` steps:

- ``miou``: the task's metric, ``tasks.segment.SegmentationMetric``: one confusion matrix over all
  100 scenes (ignore pixels left out), mean IoU over the classes present;
- ``identity``: share of the digit pixels whose argmax over the 10 *digit* logits is the right
  digit (chance 0.10), i.e. identity regardless of the foreground/background decision;
- ``fg_iou``: class-agnostic IoU of "any digit" against the truth (the stroke masks alone).

``crops`` trains a plain classifier (backbone + linear) on the scenes' digits cut out by their
mask boxes and resized to 64 px: the reference for how fast identity is learnt when the digit is
centred and fills the input. ``--save`` keeps its backbone so ``dense --init`` can start from it.

    python benchmarks/seg_demo_probe.py dense --steps 1000 --threads 1
    python benchmarks/seg_demo_probe.py dense --steps 1000 --output-stride 16 --head pspnet
    python benchmarks/seg_demo_probe.py crops --steps 300 --save /tmp/crops_backbone.pt
    python benchmarks/seg_demo_probe.py dense --steps 1000 --init /tmp/crops_backbone.pt
    python benchmarks/seg_demo_probe.py dense --steps 4125 --eval-every 500 --backbone convmixer --dim 128 --kernel 9
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from backbones import MobileViTv2  # noqa: E402
from backbones.convmixer import ConvMixer  # noqa: E402
from datamodules.segmentation import IGNORE_INDEX, SegmentationDataModule  # noqa: E402
from heads.deeplabv3 import DeepLabV3  # noqa: E402
from heads.pspnet import PSPNet  # noqa: E402
from configs.recipes import recipe_path  # noqa: E402
from tasks.engine.optim import WarmupCosineLR  # noqa: E402
from tasks.segment import SegmentationMetric, SegmentationTask  # noqa: E402

#: the demo recipe: the probe's defaults and everything it does not vary come from it
RECIPE = yaml.safe_load(recipe_path("segment", "demo_deeplabv3_mobilevitv2.yaml").read_text())
#: the default demo's backbone (ConvMixer on the MobileViTv2 recipe): ``--backbone convmixer``'s defaults
CONVMIXER = yaml.safe_load(recipe_path("segment", "demo_deeplabv3_convmixer.yaml").read_text())["model"]["backbone"]


def demo_data(args) -> SegmentationDataModule:
    data = SegmentationDataModule(**{**RECIPE["data"], "crop_size": args.crop, "batch_size": args.batch, "num_workers": 0})
    data.setup("fit")
    return data


def recipe_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), **{**RECIPE["model"]["optimizer"]["init_args"], "lr": lr})


def backbone(args) -> nn.Module:
    if args.backbone == "convmixer":
        model = ConvMixer(dim=args.dim, depth=args.depth, kernel_size=args.kernel,
                          patch_size=CONVMIXER["init_args"]["patch_size"])
    else:
        model = MobileViTv2(width=args.width, output_stride=args.output_stride)
    if args.init:
        model.load_state_dict(torch.load(args.init))
    return model


@torch.no_grad()
def evaluate(model: SegmentationTask, data: SegmentationDataModule) -> dict[str, float]:
    model.eval()
    metric = SegmentationMetric(data.num_classes)
    right = digit_pixels = fg_inter = fg_union = 0
    for i in range(len(data.val_set)):
        item = data.val_set[i]
        target = item["mask"][None]
        logits = model(item["image"][None], size=target.shape[-2:])["out"]
        preds = logits.argmax(1)
        metric.update(preds, target)
        digits = (target > 0) & (target != IGNORE_INDEX)
        right += int((logits[:, 1:].argmax(1) + 1)[digits].eq(target[digits]).sum())
        digit_pixels += int(digits.sum())
        predicted = (preds > 0) & (target != IGNORE_INDEX)
        fg_inter += int((predicted & digits).sum())
        fg_union += int((predicted | digits).sum())
    model.train()
    return {"miou": float(metric.scores()["miou"]), "identity": right / max(digit_pixels, 1),
            "fg_iou": fg_inter / max(fg_union, 1)}


def dense(args) -> None:
    data = demo_data(args)
    rates = [int(r) for r in args.rates.split(",")]
    if args.head == "deeplabv3":
        head = lambda channels, k, **kw: DeepLabV3(channels, k, channels=args.channels, atrous_rates=rates, **kw)  # noqa: E731
    else:
        head = lambda channels, k, **kw: PSPNet(channels, k, channels=args.channels, **kw)  # noqa: E731
    model = SegmentationTask(backbone(args), data.class_names, head=head,
                             class_weights=[args.background_weight] + [1.0] * (data.num_classes - 1))
    optimizer = recipe_optimizer(model, args.lr)
    schedule = WarmupCosineLR(optimizer, total_steps=args.steps, **RECIPE["model"]["scheduler"]["init_args"])
    loader = torch.utils.data.DataLoader(data.train_set, batch_size=args.batch, shuffle=True, drop_last=True)
    # the task's own training loss; its self.log calls are no-ops without a Trainer
    warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
    step, start = 0, time.perf_counter()
    while step < args.steps:
        for batch in loader:
            loss = model.training_loss(batch, step)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["trainer"]["gradient_clip_val"])
            optimizer.step()
            schedule.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                scores = evaluate(model, data)
                print(f"step {step:5d}  {time.perf_counter() - start:6.0f} s  loss {loss.item():.3f}  "
                      + "  ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True)
            if step == args.steps:
                break


def digit_crops(data: SegmentationDataModule, split: str, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Every digit of ``split`` larger than 10x10 px, cut out square around its mask box (+4 px), resized:
    ((N, 3, size, size) normalised like the datamodule, (N,) digit 0..9)."""
    from PIL import Image
    from scipy import ndimage

    images, labels = [], []
    for image_path, mask_path in data._split_samples(split):
        image, mask = np.asarray(Image.open(image_path).convert("RGB")), np.asarray(Image.open(mask_path))
        for label in range(1, data.num_classes):
            regions, _ = ndimage.label(mask == label)
            for rows, cols in filter(None, ndimage.find_objects(regions)):
                side = max(rows.stop - rows.start, cols.stop - cols.start)
                if side < 10:
                    continue
                top = max((rows.start + rows.stop - side) // 2 - 4, 0)
                left = max((cols.start + cols.stop - side) // 2 - 4, 0)
                crop = Image.fromarray(image[top:top + side + 8, left:left + side + 8]).resize((size, size), Image.BILINEAR)
                images.append(np.asarray(crop))
                labels.append(label - 1)
    pixels = torch.tensor(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0
    mean, std = (torch.tensor(v)[:, None, None] for v in (data.hparams.mean, data.hparams.std))
    return (pixels - mean) / std, torch.tensor(labels)


def crops(args) -> None:
    data = demo_data(args)
    train_x, train_y = digit_crops(data, "train")
    val_x, val_y = digit_crops(data, "val")
    print(f"{len(train_y)} training crops, {len(val_y)} validation crops")
    args.output_stride = 32
    features = backbone(args)
    classifier = nn.Linear(features.feature_channels[max(features.feature_channels)], 10)
    model = nn.ModuleList([features, classifier])
    optimizer = recipe_optimizer(model, args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        chosen = torch.randint(0, len(train_y), (32,))
        loss = F.cross_entropy(classifier(features.forward_pooled(train_x[chosen])), train_y[chosen])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                accuracy = (classifier(features.forward_pooled(val_x)).argmax(1) == val_y).float().mean()
            model.train()
            print(f"step {step:5d}  {time.perf_counter() - start:6.0f} s  loss {loss.item():.3f}  "
                  f"val accuracy {accuracy:.3f}", flush=True)
    if args.save:
        torch.save(features.state_dict(), args.save)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["dense", "crops"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    backbone_args, head_args = RECIPE["model"]["backbone"]["init_args"], RECIPE["model"]["head"]["init_args"]
    parser.add_argument("--backbone", choices=["mobilevitv2", "convmixer"], default="mobilevitv2",
                        help="dense mode: the MobileViTv2 demo's backbone or the default demo's ConvMixer (8 px patches)")
    parser.add_argument("--dim", type=int, default=CONVMIXER["init_args"]["dim"], help="ConvMixer width")
    parser.add_argument("--depth", type=int, default=CONVMIXER["init_args"]["depth"], help="ConvMixer depth")
    parser.add_argument("--kernel", type=int, default=CONVMIXER["init_args"]["kernel_size"], help="ConvMixer kernel")
    parser.add_argument("--width", type=float, default=backbone_args["width"], help="MobileViTv2 width")
    parser.add_argument("--output-stride", type=int, default=backbone_args["output_stride"])
    parser.add_argument("--init", help="backbone state dict to start from (e.g. crops --save)")
    parser.add_argument("--head", choices=["deeplabv3", "pspnet"], default="deeplabv3")
    parser.add_argument("--channels", type=int, default=head_args["channels"])
    parser.add_argument("--rates", default=",".join(map(str, head_args["atrous_rates"])), help="ASPP atrous rates")
    parser.add_argument("--crop", type=int, default=RECIPE["data"]["crop_size"])
    parser.add_argument("--batch", type=int, default=RECIPE["data"]["batch_size"])
    parser.add_argument("--lr", type=float, default=RECIPE["model"]["optimizer"]["init_args"]["lr"])
    parser.add_argument("--background-weight", type=float, default=RECIPE["model"]["class_weights"][0])
    parser.add_argument("--save", help="crops: write the trained backbone's state dict here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    (dense if args.mode == "dense" else crops)(args)


if __name__ == "__main__":
    main()
