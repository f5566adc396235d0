"""The exponential moving average of the weights that the paper recipes keep (Lightning's ``EMAWeightAveraging``),
updated with a few foreach kernels and without the host waiting for the device.

Lightning's callback averages with torch's ``AveragedModel(avg_fn=...)``: one ``decay * ema + (1 - decay) * w``
per tensor (three kernels each: for MobileViTv2-1.0 more kernels than the training step itself), and two reads
of the device counter ``n_averaged`` per update (``bool(n_averaged == 0)``, ``if n_averaged > 0``), each a host
sync on a GPU. :class:`ForeachEMA` keeps the same module, the same ``n_averaged`` buffer (so the same checkpoint
keys) and the same formula, but

- updates with torch's public ``get_ema_multi_avg_fn``: one ``_foreach_lerp_`` per (device, dtype) group;
- counts its updates on the host too, reading ``n_averaged`` once after it is built or loaded;
- leaves integer buffers (BatchNorm's ``num_batches_tracked``) out of the average, as CVNets' EMA
  (``corenet/modeling/misc/averaging_utils.py``, ``EMA.update_parameters`` averages floating-point
  state only) and timm's ``ModelEmaV3`` (``apply_update_``: ``if ema_v.is_floating_point()``) do.
  The average keeps the counter it was copied with; BatchNorm reads it only with ``momentum=None``.

Floating-point values differ from Lightning's by rounding only (``lerp`` against ``decay*a + (1-decay)*b``) and
equal torch's own ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` exactly
(``tests/test_ema.py``). :func:`use_foreach_ema` gives a Lightning ``EMAWeightAveraging`` this average in place
of its own; ``TaskModule.setup`` does it for every such callback of a run, so the recipes keep naming
Lightning's callback, and its checkpoints, validation swap and resume are Lightning's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class ForeachEMA(AveragedModel):
    """An exponential moving average of ``model``'s floating-point parameters and buffers
    (``ema = lerp(ema, w, 1 - decay)``), the first update a copy.

    Args:
        model: the network to average (deep-copied, as ``AveragedModel`` does).
        decay: the weight of the old average, in [0, 1] (CVNets' ``ema_momentum`` m is ``1 - decay``).
        use_buffers: average the floating-point buffers too (BatchNorm's running statistics); ``False``
            copies every buffer from ``model`` at each update instead.
        device: where the average lives; ``None``: where ``model`` is.
    """

    def __init__(self, model: nn.Module, decay: float, use_buffers: bool = True,
                 device: torch.device | str | None = None):
        super().__init__(model, device=device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=use_buffers)
        self.decay = decay
        #: updates so far, on the host (``n_averaged`` on the device); ``None`` until read after a load
        self.updates: int | None = 0
        self.register_load_state_dict_post_hook(ForeachEMA._forget_host_count)

    @staticmethod
    def _forget_host_count(module: "ForeachEMA", incompatible_keys) -> None:
        module.updates = None  # a loaded n_averaged: read it once, at the next update

    def averaged_pairs(self, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(average, current) of each tensor the average follows, in ``AveragedModel``'s order."""
        mine = list(self.module.parameters())
        theirs = list(model.parameters())
        if self.use_buffers:
            mine += list(self.module.buffers())
            theirs += list(model.buffers())
        if len(mine) != len(theirs):
            raise ValueError(f"the model has {len(theirs)} tensors to average, its average {len(mine)}: "
                             "the network changed after the average was made")
        return [(a.detach(), w.detach()) for a, w in zip(mine, theirs)]

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self.updates is None:
            self.updates = int(self.n_averaged)  # once after a checkpoint was loaded, not every step
        pairs = self.averaged_pairs(model)
        if self.updates == 0:
            for average, current in pairs:
                average.copy_(current)
        else:
            groups: dict[tuple, tuple[list, list]] = {}
            for average, current in pairs:
                if average.is_floating_point():
                    averages, currents = groups.setdefault((average.device, average.dtype), ([], []))
                    averages.append(average)
                    currents.append(current.to(average.device))
            for averages, currents in groups.values():
                self.multi_avg_fn(averages, currents, self.updates)
        if not self.use_buffers:
            for average, current in zip(self.module.buffers(), model.buffers()):
                average.detach().copy_(current.detach())
        self.n_averaged += 1  # on the device, not read back
        self.updates += 1


def ema_decay(averaged: AveragedModel) -> float | None:
    """The decay of an ``AveragedModel`` built with torch's ``get_ema_avg_fn(decay)`` (what Lightning's
    ``EMAWeightAveraging`` passes), read through the function's documented contract
    ``avg_fn(average, current, n) = decay * average + (1 - decay) * current``; ``None`` for another average."""
    if averaged.avg_fn is None or averaged.multi_avg_fn is not None:
        return None
    zero, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    decay = float(averaged.avg_fn(one, zero, 1))
    if not 0.0 <= decay <= 1.0 or float(averaged.avg_fn(zero, one, 1)) != 1.0 - decay:
        return None
    return decay


def use_foreach_ema(callback) -> bool:
    """Give a Lightning ``EMAWeightAveraging`` whose average was built (its ``setup`` of a fit) a
    :class:`ForeachEMA` of the same decay, buffers and device in place of its ``AveragedModel``.
    Returns whether it did. Call before a checkpoint is restored into it."""
    from layers.compat import weight_averaging_model, set_weight_averaging_model

    averaged = weight_averaging_model(callback)
    if averaged is None or isinstance(averaged, ForeachEMA):
        return False
    decay = ema_decay(averaged)
    if decay is None:
        return False
    device = averaged.n_averaged.device
    foreach = ForeachEMA(averaged.module, decay, use_buffers=averaged.use_buffers, device=device)
    foreach.n_averaged.copy_(averaged.n_averaged)
    foreach.updates = int(averaged.n_averaged)  # once, before training
    set_weight_averaging_model(callback, foreach)
    return True
