"""Segmentation models: parameter counts against the MobileViTv2 paper, and CPU speed side by side
with torchvision's DeepLabv3-MobileNetV3-Large in the same process.

``params``: backbone + head (auxiliary head excluded, as papers count) for the Table 3
rows (ADE20k, 150 classes; 512-channel dense ASPP / PSP as in the CVNets recipes).

``speed``: for DeepLabv3-MobileViTv2-0.75 at output stride 16 and 8, and the torchvision
peer (output stride 16, 256-channel ASPP, no aux head):

- training images/s: forward, upsampling to the crop, cross-entropy, backward and an
  SGD step on a (batch, 3, crop, crop) batch, train mode;
- evaluation images/s: one (1, 3, crop, crop * 4/3) image (a 512-short-side ADE20k
  image), forward and upsampling, eval mode, ``torch.inference_mode`` (our evaluation
  runs one image per step).

Models are measured interleaved (ours, peer, ours, ...) so that load from other
processes hits all alike; the best of ``--reps`` is reported (on a shared machine other
processes only ever add time). Beside wall-clock images/s, images per CPU-second of
this process (``time.process_time``, all its threads) are reported: on a machine shared
with other jobs they change far less than wall time, and with T threads an idle machine
gives at most T times that many images per second.

    nice python benchmarks/bench_segment.py params
    nice python benchmarks/bench_segment.py speed --crop 512 --batch 4 --reps 3 --threads 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backbones.mobilevitv2 import MobileViTv2  # noqa: E402
from heads.deeplabv3 import ATROUS_RATES, DeepLabV3  # noqa: E402
from heads.pspnet import PSPNet  # noqa: E402

#: MobileViTv2 paper, Table 3 (ADE20k): (head, width, parameters in millions)
PAPER_TABLE3 = [("PSPNet", 0.5, 3.6), ("DeepLabv3", 0.75, 9.6), ("PSPNet", 1.75, 22.5), ("DeepLabv3", 2.0, 34.0)]


class Segmenter(nn.Module):
    """Backbone + head + upsampling to the input size, as ``tasks.segment`` runs them: (B, 3, H, W) -> (B, K, H, W)."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.backbone(x))["out"]
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


class TorchvisionPeer(nn.Module):
    """torchvision's DeepLabv3-MobileNetV3-Large (random weights), logits only: (B, 3, H, W) -> (B, K, H, W)."""

    def __init__(self, num_classes: int):
        super().__init__()
        from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

        self.model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes,
                                                  aux_loss=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def params_table() -> str:
    rows = ["| model | backbone (M) | head (M) | total (M) | paper Table 3 (M) |", "| --- | --- | --- | --- | --- |"]
    for head_name, width, paper in PAPER_TABLE3:
        backbone = MobileViTv2(width=width, output_stride=8)
        make = DeepLabV3 if head_name == "DeepLabv3" else PSPNet
        head = make(backbone.feature_channels, 150, channels=512)
        total = count(backbone) + count(head)
        rows.append(f"| {head_name}-MobileViTv2-{width} | {count(backbone) / 1e6:.3f} | {count(head) / 1e6:.3f} "
                    f"| {total / 1e6:.3f} | {paper} |")
    peer = TorchvisionPeer(150)
    rows.append(f"| torchvision DeepLabv3-MobileNetV3-Large (peer) | | | {count(peer) / 1e6:.3f} | |")
    return "\n".join(rows)


def ours(width: float, output_stride: int, num_classes: int) -> nn.Module:
    backbone = MobileViTv2(width=width, output_stride=output_stride)
    head = DeepLabV3(backbone.feature_channels, num_classes, channels=512, atrous_rates=ATROUS_RATES[output_stride])
    return Segmenter(backbone, head)


def train_seconds(model: nn.Module, images: torch.Tensor, target: torch.Tensor, optimizer) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one training step."""
    model.train()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = F.cross_entropy(model(images), target, ignore_index=255)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def eval_seconds(model: nn.Module, image: torch.Tensor) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one evaluation forward."""
    model.eval()
    with torch.inference_mode():
        wall, cpu = time.perf_counter(), time.process_time()
        model(image)
        return time.perf_counter() - wall, time.process_time() - cpu


def speed_table(crop: int, batch: int, reps: int, num_classes: int) -> str:
    torch.manual_seed(0)
    models = {
        "DeepLabv3-MobileViTv2-0.75, OS 16": ours(0.75, 16, num_classes),
        "DeepLabv3-MobileViTv2-0.75, OS 8": ours(0.75, 8, num_classes),
        "torchvision DeepLabv3-MobileNetV3-L, OS 16 (peer)": TorchvisionPeer(num_classes),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for name, m in models.items()}
    images = torch.randn(batch, 3, crop, crop)
    target = torch.randint(0, num_classes, (batch, crop, crop))
    image = torch.randn(1, 3, crop, crop * 4 // 3)
    train = {name: [] for name in models}
    evals = {name: [] for name in models}
    for name, model in models.items():  # warm-up
        train_seconds(model, images, target, optimizers[name])
        eval_seconds(model, image)
    for _ in range(reps):
        for name, model in models.items():
            train[name].append(train_seconds(model, images, target, optimizers[name]))
            evals[name].append(eval_seconds(model, image))
    rows = [f"| model | params (M) | train img/s ({batch}x{crop}x{crop}) | train img/CPU-s "
            f"| eval img/s (1x{crop}x{crop * 4 // 3}) | eval img/CPU-s |", "| --- | --- | --- | --- | --- | --- |"]
    for name, model in models.items():
        best_train = min(train[name])
        best_eval = min(evals[name])
        rows.append(f"| {name} | {count(model) / 1e6:.2f} | {batch / best_train[0]:.2f} | {batch / best_train[1]:.2f} "
                    f"| {1 / best_eval[0]:.2f} | {1 / best_eval[1]:.2f} |")
    return "\n".join(rows)


def main() -> None:
    from tasks.cli.runtime import reuse_freed_memory

    reuse_freed_memory()  # as the CLIs do; ours and the peer share this process, so both get it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["params", "speed"])
    parser.add_argument("--crop", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--classes", type=int, default=150)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.what == "params":
        print(params_table())
    else:
        print(speed_table(args.crop, args.batch, args.reps, args.classes))


if __name__ == "__main__":
    main()
