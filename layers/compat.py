"""The one place where the suite reaches into other libraries' private names.

Everything else uses public APIs. Each access here says why no public API does it, and
``tests/test_compat.py`` fails naming the library version and the private name when an upgrade
removes or changes one, so an upgrade breaks loudly here instead of silently elsewhere. It sits on
the floor (``layers/``) because the layers use it too; the libraries it touches are imported only
inside the function that needs them.
"""
from __future__ import annotations

#: (module, private name, what the suite uses it for): checked by tests/test_compat.py
PRIVATE_NAMES = [
    ("torch.utils._python_dispatch", "is_in_torch_dispatch_mode",
     "layers.cpu_speedups: the CPU speed paths step aside for the FLOP counter and other dispatch modes"),
    ("torch.utils._python_dispatch", "TorchDispatchMode",
     "tests/test_fusion.py: an op log that shows which aten ops a block runs (in-place activations)"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode",
     "benchmarks/bench_kernels.py: a network run on fake CUDA tensors takes CUDA's dispatch decisions without a GPU"),
    ("torch._ops", "OpOverload._schema",
     "benchmarks/bench_kernels.py (op_arguments): which arguments an aten op writes, for the bytes it moves"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention",
     "benchmarks/bench_kernels.py: the flash attention kernel CUDA's SDPA picks, run on fake CUDA tensors"),
    ("torch._C._autograd", "_InputMetadata",
     "benchmarks/bench_kernels.py: what an autograd node's _input_metadata holds, the shape and dtype of each "
     "gradient it expects (tests/test_bench_kernels.py runs it)"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu",
     "layers.attention.register_cpu_sdpa_flops: the FLOP counter's formula for CPU attention"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward",
     "layers.attention.register_cpu_sdpa_flops: the same for its backward"),
    ("torchvision.transforms.v2", "RandAugment._apply_image_or_video_transform",
     "datamodules.classification_transforms.FastRandAugment overrides it: RandAugment has no public per-op hook, "
     "and this one method is where its ops meet the image"),
    ("torch.optim", "Adam._step_supports_amp_scaling",
     "layers.compat.supports_device_skip: which optimizers can skip an update on the device (the fused ones)"),
    ("torch.optim", "Adam.found_inf",
     "layers.compat.skip_update_on_device: the non-finite-loss guard skips a fused update without a host read"),
    ("litdata", "StreamingDataLoader.restore",
     "datamodules.streaming (forget_restored_position): drop a resumed position once its epoch has begun"),
    ("torchmetrics", "Metric._sync_dist",
     "layers.compat.GathersOwnStates overrides it: the COCO and VOC mAP metrics gather states that differ in "
     "length between ranks themselves"),
    ("lightning.pytorch.callbacks", "WeightAveraging._average_model",
     "layers.compat.weight_averaging_model: tasks.engine.ema gives Lightning's EMAWeightAveraging an average updated "
     "with foreach kernels and a host counter; the callback builds its AveragedModel in setup with no public hook"),
    ("torch.amp", "GradScaler._scale",
     "layers.compat.loss_scale_state: an fp16 step the guard skipped for an empty batch keeps its loss scale"),
    ("torch.amp", "GradScaler._growth_tracker",
     "layers.compat.loss_scale_state: ... and its count of steps towards growing it"),
    ("torch._inductor", "aoti_compile_and_package",
     "tasks.export.aoti: AOTInductor's packaging entry point, which torch documents under torch._inductor only"),
    ("torch._inductor", "aoti_load_package",
     "tasks.export.aoti: ... and the loader that runs a package back for the parity checks"),
    ("torch.nn.modules.batchnorm", "_BatchNorm",
     "layers.compat.is_batchnorm: which layers normalise with the batch's statistics while training"),
    ("torch.cuda", "_sleep",
     "layers.compat.spin_cuda_stream: benchmarks/gpu_nccl.py holds a stream busy past a collective's timeout"),
    ("torch.distributed", "ProcessGroup._get_backend",
     "layers.compat.process_group_timeout: the backend whose options hold a process group's timeout"),
    ("torch._C._distributed_c10d", "Backend.Options._timeout",
     "layers.compat.process_group_timeout: ... the timeout itself, which NCCL's watchdog reads"),
    ("lightning.pytorch.strategies", "DDPStrategy._timeout",
     "layers.compat.strategy_timeout: the timeout a DDP or FSDP strategy gives its process group"),
]


def in_dispatch_mode() -> bool:
    """Whether a ``TorchDispatchMode`` (the FLOP counter, an op logger) is active. torch offers no
    public test for it; the CPU speed paths must then run the plain ops the mode expects to see."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return is_in_torch_dispatch_mode()


def torch_dispatch_mode() -> type:
    """The base class of an op-intercepting mode (``__torch_dispatch__``). torch documents it under this
    private module path and exports it nowhere else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def fake_tensor_mode() -> type:
    """The mode whose tensors carry shapes, strides, dtypes and a device (CUDA too) but no data. torch has
    no public module for it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def autograd_input_metadata(node) -> tuple:
    """Shape and dtype (``.shape``, ``.dtype``) of each gradient an autograd node receives, which autograd's
    engine checks between nodes; torch exposes them only as this attribute of the node."""
    return node._input_metadata


def op_arguments(op) -> list:
    """The declared arguments of an aten op overload (name, type, ``alias_info.is_write`` for the ones it
    writes in place); torch keeps its schema in this attribute only."""
    return op._schema.arguments


def cpu_sdpa_kernels() -> tuple:
    """(forward, backward) aten ops SDPA runs on CPU. They have no public alias, and the FLOP counter
    registers formulas by op."""
    import torch

    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward)


def gettext_catalog(translations) -> dict:
    """Every message of a ``gettext`` translation (the demo corpus reads pycountry's catalogs whole).
    The standard library can look messages up one by one but not list them."""
    return translations._catalog


def babel_locale_data(locale) -> dict:
    """A babel ``Locale``'s raw CLDR tree (the demo corpus walks its name and pattern sections); babel
    exposes selected properties only."""
    return locale._data


def forget_restored_position(loader) -> None:
    """Make a LitData ``StreamingDataLoader`` start its next epoch from the beginning. LitData keeps a
    position loaded with ``load_state_dict`` until an iteration runs to its very end, which Lightning
    never asks of a loader with a length, so the epoch after a resumed one would replay the position;
    LitData has no public call to drop it."""
    loader.restore = False


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can skip its update on the device (:func:`skip_update_on_device`):
    torch's fused optimizers declare it with the flag gradient scalers check."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skip_update_on_device(optimizer: torch.optim.Optimizer, skip: torch.Tensor | None) -> None:
    """Make the next ``optimizer.step()`` of a fused torch optimizer leave parameters, state and step
    count unchanged where ``skip`` (a 0-d bool tensor on the parameters' device) is true, decided by
    the kernel without the host reading ``skip``; ``None`` removes the condition. This is the
    ``found_inf`` attribute a gradient scaler sets before such a step (torch.amp.GradScaler.step);
    torch has no public argument for it, and ``tests/test_host_sync.py`` checks that each fused
    optimizer still honours it."""
    if skip is None:
        vars(optimizer).pop("found_inf", None)
        return
    optimizer.found_inf = skip.float()


def weight_averaging_model(callback):
    """The ``AveragedModel`` a Lightning ``WeightAveraging`` callback built in its ``setup`` (``None`` before, or
    outside ``fit``). Lightning keeps it in this attribute only; its checkpoint, validation-swap and resume hooks
    read it from there."""
    return getattr(callback, "_average_model", None)


def set_weight_averaging_model(callback, averaged) -> None:
    """Replace the average of a Lightning ``WeightAveraging`` callback (see :func:`weight_averaging_model`);
    Lightning builds it inside ``setup`` and takes no factory for it (its ``AveragedModel`` keyword arguments
    cannot change how ``update_parameters`` reads the device counter)."""
    callback._average_model = averaged


def loss_scale_state(scaler) -> tuple:
    """(scale, growth tracker): the 1-element device tensors a ``torch.amp.GradScaler`` keeps after its first
    ``scale()``, which ``update()`` rewrites on the device. ``get_scale()`` reads the scale on the host (a sync)
    and nothing public writes it back without one."""
    return scaler._scale, scaler._growth_tracker


def spin_cuda_stream(cycles: int) -> None:
    """Queue a kernel on the current CUDA stream that spins ``cycles`` GPU clock cycles: what torch's own
    distributed tests use to hold a stream busy (a collective queued behind it cannot finish). No public op
    occupies a stream for a chosen time."""
    import torch

    torch.cuda._sleep(cycles)


def process_group_timeout(device) -> "timedelta":
    """The timeout of the default process group's backend for ``device``: the value NCCL's watchdog (and gloo's
    waits) act on. torch sets it publicly (``dist.set_timeout``) but has no getter."""
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(device).options._timeout


def strategy_timeout(strategy) -> "timedelta | None":
    """The process-group timeout a Lightning DDP or FSDP strategy was given (``None`` for other strategies);
    Lightning keeps it without a property."""
    return getattr(strategy, "_timeout", None)


def is_batchnorm(module) -> bool:
    """Whether ``module`` is a torch batch normalisation layer (BatchNorm1d/2d/3d, their lazy forms,
    SyncBatchNorm, and subclasses), the layers that normalise with the batch's statistics while
    training. They share only this private base; a list of the public classes would silently miss
    one that torch adds."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm)


class GathersOwnStates:
    """Base, before torchmetrics' ``Metric``, of a metric that gathers its states across processes
    itself, in its own ``sync_states(group)`` (the process group, ``None`` for all processes).

    torchmetrics (``Metric._sync_dist``, which this overrides) gathers a list state with one collective
    per element, and its public ``dist_sync_fn`` argument is called once per element too: ranks that
    hold different numbers of elements (images, batches) would wait on each other forever. With a
    ``"cat"`` reduction it gathers one concatenated tensor instead, which loses where each image's
    rows end, and a rank without data sends a 1-d float placeholder that other ranks' (N, 4) boxes
    cannot meet. torchmetrics still copies the states before the gathering and restores them after
    ``compute()`` (``sync`` / ``unsync``)."""

    def _sync_dist(self, dist_sync_fn=None, process_group=None) -> None:
        self.sync_states(process_group or self.process_group)

    def sync_states(self, group) -> None:  # pragma: no cover - each metric's own
        raise NotImplementedError
