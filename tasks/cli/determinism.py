"""``--trainer.deterministic true`` on CUDA: allowed where every op of the run has a deterministic
CUDA kernel, refused up front, naming the ops, where one has none.

Lightning's ``deterministic=True`` calls ``torch.use_deterministic_algorithms(True)``. An op with only
a non-deterministic CUDA kernel then raises at its first call, which for a backward op is minutes
into a run, after data preparation and the first validation. torch's documentation of
``use_deterministic_algorithms`` lists those ops ("will throw a RuntimeError"); the ones below are
that list as aten ops, the names a dispatch mode sees. The ops that list says act deterministically
under the setting instead (convolutions, ``index_put`` with accumulation, ``scatter_add_``,
``gather``, embedding and ``index_select`` backward, ``cumsum``) are allowed, and so is SDPA, whose
flash and memory-efficient CUDA backward switch to their deterministic variant under the setting.

What each task's networks run (``cuda_nondeterministic_ops`` in its declaration, :data:`HEAD_OPS`) is stated
per task and checked against the ops a real fit dispatches (``tests/test_determinism.py``, :class:`NondeterministicOpLog`);
composite ops decompose above the device, so a CPU fit dispatches the same aten ops as a CUDA one.
Only segmentation uses such ops: its logits are upsampled bilinearly to the crop before the loss and
its loss is a per-pixel cross-entropy (``nll_loss2d``, atomics in CUDA's mean reduction); PSPNet's
pyramid pooling adds adaptive average pooling to 2x2, 3x3 and 6x6 (a 1x1 output is a mean, which
is deterministic). A MobileViT backbone fed a size that is not a multiple of its ``size_multiple``
resizes bilinearly inside its blocks; the recipes' training sizes are multiples, and for any other
torch's own error names the op.

``deterministic: warn`` keeps the deterministic kernels where they exist and warns at the others;
the suite's resume check uses it where ``true`` is refused, and judges the resumed run against the
difference between two uninterrupted runs (``benchmarks/gpu_cli.py``).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from configs.tasks import TaskDeclaration, task_declaration
from layers.compat import torch_dispatch_mode

#: cuBLAS is deterministic only with a fixed workspace, read when CUDA creates its handle
CUBLAS_WORKSPACE = ":4096:8"


def _always(args: tuple, kwargs: dict) -> bool:
    return True


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    """An op's argument by its place in the aten schema (or its name, if passed by keyword)."""
    return kwargs.get(name, args[index] if len(args) > index else default)


def _reduces(args: tuple, kwargs: dict) -> bool:  # nll_loss2d_forward(self, target, weight, reduction, ...)
    return _argument(args, kwargs, 3, "reduction", 1) != 0  # 0: Reduction::None


def _weighted(args: tuple, kwargs: dict) -> bool:  # bincount(self, weights=None, minlength=0)
    return _argument(args, kwargs, 1, "weights", None) is not None


def _max_mode(args: tuple, kwargs: dict) -> bool:  # _embedding_bag_backward(grad, ..., mode (8th), ...)
    return _argument(args, kwargs, 8, "mode", 0) == 2  # EmbeddingBag's mode='max'


def _product(args: tuple, kwargs: dict) -> bool:  # scatter_reduce.two(self, dim, index, src, reduce, ...)
    return _argument(args, kwargs, 4, "reduce", "") == "prod"


#: aten op -> (what a user wrote, when it has no deterministic CUDA kernel), from the "will throw a
#: RuntimeError" list of torch.use_deterministic_algorithms' documentation
CUDA_NONDETERMINISTIC: dict[str, tuple[str, Callable[[tuple, dict], bool]]] = {
    "avg_pool3d_backward": ("nn.AvgPool3d backward", _always),
    "_adaptive_avg_pool2d_backward": ("nn.AdaptiveAvgPool2d backward (outputs larger than 1x1)", _always),
    "_adaptive_avg_pool3d_backward": ("nn.AdaptiveAvgPool3d backward", _always),
    "adaptive_max_pool2d_backward": ("nn.AdaptiveMaxPool2d backward", _always),
    "fractional_max_pool2d_backward": ("nn.FractionalMaxPool2d backward", _always),
    "fractional_max_pool3d_backward": ("nn.FractionalMaxPool3d backward", _always),
    "max_unpool2d": ("nn.MaxUnpool1d/2d", _always),
    "max_unpool3d": ("nn.MaxUnpool3d", _always),
    "upsample_linear1d_backward": ("F.interpolate(mode='linear') backward", _always),
    "upsample_bilinear2d_backward": ("F.interpolate(mode='bilinear') backward", _always),
    "_upsample_bilinear2d_aa_backward": ("F.interpolate(mode='bilinear', antialias=True) backward", _always),
    "upsample_bicubic2d_backward": ("F.interpolate(mode='bicubic') backward", _always),
    "_upsample_bicubic2d_aa_backward": ("F.interpolate(mode='bicubic', antialias=True) backward", _always),
    "upsample_trilinear3d_backward": ("F.interpolate(mode='trilinear') backward", _always),
    "reflection_pad1d_backward": ("nn.ReflectionPad1d backward", _always),
    "reflection_pad2d_backward": ("nn.ReflectionPad2d backward", _always),
    "reflection_pad3d_backward": ("nn.ReflectionPad3d backward", _always),
    "nll_loss2d_forward": ("F.cross_entropy / F.nll_loss over a map (per-pixel), mean or sum", _reduces),
    "_ctc_loss_backward": ("nn.CTCLoss backward", _always),
    "_embedding_bag_backward": ("nn.EmbeddingBag(mode='max') backward", _max_mode),
    "put_": ("Tensor.put_", _always),
    "put": ("Tensor.put", _always),
    "histc": ("torch.histc", _always),
    "bincount": ("torch.bincount with weights", _weighted),
    "grid_sampler_2d_backward": ("F.grid_sample backward", _always),
    "grid_sampler_3d_backward": ("F.grid_sample backward", _always),
    "scatter_reduce": ("Tensor.scatter_reduce(reduce='prod')", _product),
    "scatter_reduce_": ("Tensor.scatter_reduce_(reduce='prod')", _product),
}
#: overloads of ops that are non-deterministic only in that overload (torch.median with indices)
CUDA_NONDETERMINISTIC_OVERLOADS = {("median", "dim"): "torch.median(dim=...) (values and indices)",
                                   ("nanmedian", "dim"): "torch.nanmedian(dim=...) (values and indices)"}

#: a head's class path -> the ops it adds, as a task declares its own (``cuda_nondeterministic_ops`` in
#: ``configs/<task>/task.yaml``): op -> (where it comes from, whether only training runs it)
HEAD_OPS: dict[str, dict[str, tuple[str, bool]]] = {
    "heads.pspnet.PSPNet": {
        "_adaptive_avg_pool2d_backward": ("PSPNet's pyramid pooling to 2x2, 3x3 and 6x6", True),
        "upsample_bilinear2d_backward": ("PSPNet's pooled maps upsampled bilinearly to the feature map", True),
    },
}


def nondeterministic_name(func, args: tuple, kwargs: dict) -> str | None:
    """The aten op's name if ``func(*args, **kwargs)`` has no deterministic CUDA kernel, else None."""
    packet, _, overload = func.name().removeprefix("aten::").partition(".")
    if (packet, overload) in CUDA_NONDETERMINISTIC_OVERLOADS:
        return packet
    entry = CUDA_NONDETERMINISTIC.get(packet)
    return packet if entry is not None and entry[1](args, kwargs) else None


def describe(op: str) -> str:
    """What a user wrote to run the aten op ``op`` (a name from :data:`CUDA_NONDETERMINISTIC`)."""
    if op in CUDA_NONDETERMINISTIC:
        return CUDA_NONDETERMINISTIC[op][0]
    return next(text for (packet, _), text in CUDA_NONDETERMINISTIC_OVERLOADS.items() if packet == op)


class NondeterministicOpLog(torch_dispatch_mode()):
    """Records the ops that would raise under ``torch.use_deterministic_algorithms(True)`` on CUDA
    (:data:`CUDA_NONDETERMINISTIC`), whatever device the tensors are on: ``found`` maps each to its count."""

    def __init__(self):
        super().__init__()
        self.found: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = nondeterministic_name(func, args, kwargs)
        if name is not None:
            self.found[name] = self.found.get(name, 0) + 1
        return func(*args, **kwargs)


def task_name(task: str | type | TaskDeclaration) -> str:
    """``"segment"`` for ``tasks.segment.SegmentationTask`` (the class, its declaration, or its name)."""
    if isinstance(task, TaskDeclaration):
        return task.name
    return task if isinstance(task, str) else task.__module__.rsplit(".", 1)[-1]


def run_ops(task: str | type | TaskDeclaration, head: str | None = None, training: bool = True) -> dict[str, str]:
    """The ops without a deterministic CUDA kernel that ``task`` runs (as its declaration states them, with
    ``head``'s class path), each with where it comes from; ``training=False``: only those an evaluation
    (forward) runs."""
    declaration = task if isinstance(task, TaskDeclaration) else task_declaration(task_name(task))
    declared = {op: (entry.where, entry.training_only) for op, entry in declaration.cuda_nondeterministic_ops.items()}
    declared |= HEAD_OPS.get(head or "", {})
    return {op: where for op, (where, backward_only) in declared.items() if training or not backward_only}


def uses_cuda(accelerator: Any) -> bool:
    """Whether Lightning's ``accelerator`` setting trains on a CUDA device here."""
    if not isinstance(accelerator, str):  # an Accelerator instance
        return type(accelerator).__name__.lower().startswith("cuda")
    name = accelerator.lower()
    return name in ("gpu", "cuda") or (name == "auto" and torch.cuda.is_available())


def deterministic_refusal(task: str | type | TaskDeclaration, deterministic: Any, accelerator: Any,
                          head: str | None = None, subcommand: str | None = "fit") -> str | None:
    """Why ``--trainer.deterministic true`` cannot run ``task`` on ``accelerator``, or None when it can
    (or was not asked for: ``warn`` never raises)."""
    if deterministic is not True or not uses_cuda(accelerator) or subcommand == "predict":
        return None
    ops = run_ops(task, head, training=subcommand in (None, "fit"))
    if not ops:
        return None
    listed = "; ".join(f"{op} ({describe(op)}: {where})" for op, where in ops.items())
    return (f"--trainer.deterministic true: {task_name(task)} on CUDA runs ops that have no deterministic CUDA kernel, "
            f"so torch would stop the run at the first of them: {listed}. Set --trainer.deterministic warn "
            "(deterministic kernels wherever torch has one, a warning at these) or run on the CPU "
            "(--trainer.accelerator cpu) for bit-identical runs.")


def check_deterministic(subcommand: str | None, trainer: Any, model: Any, task: str | type | TaskDeclaration) -> None:
    """The CLI's check before anything is built: refuses a deterministic run that CUDA cannot give
    (:func:`deterministic_refusal`) and, for one it can, fixes cuBLAS's workspace before CUDA starts
    (a later setting is read too late by a process that already made a cuBLAS handle)."""
    deterministic = _get(trainer, "deterministic")
    head = _get(_get(model, "head"), "class_path")
    reason = deterministic_refusal(task, deterministic, _get(trainer, "accelerator"), head, subcommand)
    if reason is not None:
        raise ValueError(reason)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)
