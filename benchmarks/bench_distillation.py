"""What a distillation teacher costs per training step: the classification task on the CPU, side by side.

    python benchmarks/bench_distillation.py                          # the default pairs below, 256 px, batch 8
    python benchmarks/bench_distillation.py --size 64 --batch 4 --reps 2

For each student and teacher pair, one process builds the real :class:`tasks.classify.ClassificationTask`
(with DeiT's distillation token where the student is ``deit_tiny``) and times its training step,
``training_loss`` (the teacher's forward included), backward and an AdamW update, in train mode and fp32:
without distillation, then with the teacher (soft KL, T = 1, alpha = 0.5). The two are timed in turn
after one warm-up step each, best of ``--reps``; and the teacher's forward alone (eval mode, no_grad), which is
what distillation adds. Each time is taken twice: wall-clock, and the CPU time of this process
(``time.process_time``, all its threads), which moves less when other processes share the cores. The weights are random here (the cost does not depend on them). Also printed: each
network's parameters and forward GFLOPs per image (:func:`tasks.engine.cost.count_flops`). On a shared machine
the times move with the load of other processes: compare the columns of one row, measured in turn.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: name -> (backbone builder at an image size, whether it has DeiT's distillation token)
NETWORKS = {
    "mobilevitv2_050": lambda size: _mobilevitv2(0.5),
    "mobilevitv2_100": lambda size: _mobilevitv2(1.0),
    "mobilevitv2_200": lambda size: _mobilevitv2(2.0),
    "deit_tiny": lambda size: _vit("tiny", size, True),
    "vit_small": lambda size: _vit("small", size, False),
}
PAIRS = ("mobilevitv2_050:mobilevitv2_100", "mobilevitv2_050:mobilevitv2_200", "deit_tiny:vit_small")


def _mobilevitv2(width: float):
    from backbones.mobilevitv2 import MobileViTv2

    return MobileViTv2(width=width)


def _vit(size: str, img_size: int, distillation_token: bool):
    from backbones import ViT

    return ViT(size, img_size=img_size, distillation_token=distillation_token)


def build(student: str, teacher: str | None, size: int, classes: int):
    from tasks.classify import ClassificationTask
    from tasks.engine.distillation import Distillation, Teacher

    torch.manual_seed(0)
    config = Distillation(teacher or "none") if teacher else None
    task = ClassificationTask(NETWORKS[student](size), [str(i) for i in range(classes)], distillation=config)
    if teacher:
        network = ClassificationTask(NETWORKS[teacher](size), [str(i) for i in range(classes)])
        task.teacher = Teacher(network, teacher)
    optimizer = torch.optim.AdamW(task.parameters(), lr=1e-4)
    return task.train(), optimizer


def timed(work) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process) of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def training_step(task, optimizer, batch: dict) -> None:
    task.training_loss(batch, 0).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    from tasks.engine.cost import count_flops, count_parameters

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="student:teacher, names of " + ", ".join(NETWORKS))
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*self.log.*")  # the task logs; no Trainer here

    batch = {"image": torch.randn(args.batch, 3, args.size, args.size),
             "target": torch.randint(0, args.classes, (args.batch,))}
    print(f"{args.size} px, batch {args.batch}, {args.classes} classes, fp32 train step (loss, backward, AdamW) on "
          f"the CPU ({torch.get_num_threads()} threads, torch {torch.__version__}); soft KL, T = 1, alpha = 0.5")
    print("Times in seconds, wall-clock / CPU time of the process.")
    print("| student | teacher | student params (M), GFLOPs | teacher params (M), GFLOPs | step without | "
          "step with | teacher forward | with / without |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    example = torch.zeros(1, 3, args.size, args.size)
    for pair in args.pairs:
        student, teacher = pair.split(":")
        runs = {"without": build(student, None, args.size, args.classes),
                "with": build(student, teacher, args.size, args.classes)}
        cost = {name: (count_parameters(net) / 1e6, count_flops(net, example) / 1e9)
                for name, net in (("student", runs["without"][0]), ("teacher", runs["with"][0].teacher.network))}
        for task, optimizer in runs.values():  # warm-up
            training_step(task, optimizer, batch)
        times = {name: [] for name in (*runs, "teacher")}
        for _ in range(args.reps):
            for name, (task, optimizer) in runs.items():
                times[name].append(timed(lambda: training_step(task, optimizer, batch)))
            times["teacher"].append(timed(lambda: runs["with"][0].teacher_output(batch["image"])))
        # best of the repetitions, wall-clock and CPU time each
        best = {name: tuple(min(column) for column in zip(*values)) for name, values in times.items()}

        def both(pair: tuple[float, float]) -> str:
            return f"{pair[0]:.3f} / {pair[1]:.3f}"

        ratio = (best["with"][0] / best["without"][0], best["with"][1] / best["without"][1])
        print(f"| {student} | {teacher} | {cost['student'][0]:.2f}, {cost['student'][1]:.2f} | "
              f"{cost['teacher'][0]:.2f}, {cost['teacher'][1]:.2f} | {both(best['without'])} | {both(best['with'])} | "
              f"{both(best['teacher'])} | {ratio[0]:.2f}x / {ratio[1]:.2f}x |")


if __name__ == "__main__":
    main()
