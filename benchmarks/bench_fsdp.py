"""What ``--trainer.strategy fsdp`` keeps per rank: parameters, gradients and AdamW state, sharded and not.

    python benchmarks/bench_fsdp.py                    # MobileViTv2-2.0 classifier, Transformer-base (WMT14 en-de)
    python benchmarks/bench_fsdp.py --ranks 4

Two (``--ranks``) gloo processes on the CPU shard each task model with the suite's plan
(:func:`tasks.cli.sharding.shard_task`: one FSDP unit per repeated block, the task as the root unit), take
one AdamW step on a small random batch and count, on each rank, the bytes of the tensors it holds: its
parameter shards, gradient shards and optimizer-state shards. The same step on the unsharded model in one
process gives what every DDP rank holds. Also listed: the parameters of the root unit and of the largest
block, which a rank holds whole while they compute (the root from the forward to its backward, a block
while it runs): what sharding cannot take off the peak. Counts of bytes, not timings: the same on any machine.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 2 ** 20


def classifier():
    from backbones import MobileViTv2
    from tasks.classify import ClassificationTask

    model = ClassificationTask(backbone=MobileViTv2(width=2.0), class_names=[str(i) for i in range(1000)])
    return model, (torch.randn(2, 3, 256, 256),)


def translator():
    from tasks.translate import TranslationTask

    # configs/translate/wmt14_en_de_transformer_base.yaml: d 512, 6 + 6 layers, 8 heads, FFN 2048, 37000 tokens
    model = TranslationTask(vocab_size=37000, dim=512, encoder_depth=6, decoder_depth=6, num_heads=8, ffn_dim=2048)
    tokens = torch.randint(4, 37000, (2, 16))
    return model, (tokens, tokens)


MODELS = {"MobileViTv2-2.0 classifier (ImageNet-1k head)": classifier, "Transformer-base (WMT14 en-de)": translator}


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (its shards when sharded)."""
    def size(t):
        return local(t).numel() * t.element_size()

    params = list(model.parameters())
    return {"params": sum(size(p) for p in params),
            "grads": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(v) for state in optimizer.state.values() for v in state.values()
                             if torch.is_tensor(v) and v.dim() > 0)}


def train_step(model, inputs):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = model(*inputs)
    (out.float().mean() if torch.is_tensor(out) else sum(o.float().mean() for o in out)).backward()
    optimizer.step()
    return optimizer


def unit_sizes(model) -> tuple[int, int]:
    """Parameters of the root unit (outside every repeated block) and of the largest block."""
    from layers.compile import repeated_blocks

    blocks = [block for _, network in model.named_children() for _, block in repeated_blocks(network)]
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    largest = max((sum(p.numel() for p in block.parameters()) for block in blocks), default=0)
    return root, largest


def rank_main(rank: int, ranks: int, port: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tasks.cli.sharding import shard_task

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model, inputs = build()
        shard_task(model, mesh)
        queue.put((name, rank, held_bytes(model, train_step(model, inputs))))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(args.ranks, port, queue), nprocs=args.ranks)
    sharded: dict[str, list[dict]] = {}
    while not queue.empty():
        name, rank, held = queue.get()
        sharded.setdefault(name, []).append(held)

    print(f"| model | params | held per rank, DDP (MiB) | held per rank, fsdp x{args.ranks} (MiB, largest rank) | ratio "
          f"| root unit, largest block (held whole while computing, MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model, inputs = build()
        root, largest = unit_sizes(model)
        ddp = held_bytes(model, train_step(model, inputs))
        total = sum(ddp.values())
        worst = max(sum(h.values()) for h in sharded[name])
        count = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {count / 1e6:.1f} M | {total / MB:.1f} | {worst / MB:.1f} | {worst / total:.3f} "
              f"| {root * 4 / MB:.1f}, {largest * 4 / MB:.1f} |")


if __name__ == "__main__":
    main()
