import math

import pytest
import torch
import torch.nn as nn

from tasks.engine.optim import NORM_TYPES, InverseSqrtLR, WarmupCosineLR, param_groups, schedule_arguments


def lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_warmup_cosine_hits_its_endpoints():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.002)
    sched = WarmupCosineLR(opt, warmup_steps=10, total_steps=110, warmup_init_lr=1e-6, min_lr=2e-4)
    seen = lrs(sched, opt, 111)
    assert seen[0] == pytest.approx(1e-6)
    assert seen[5] == pytest.approx(1e-6 + (0.002 - 1e-6) * 0.5)
    assert seen[10] == pytest.approx(0.002)
    assert seen[60] == pytest.approx(2e-4 + 0.5 * (0.002 - 2e-4))  # half way through the cosine
    assert seen[110] == pytest.approx(2e-4)
    assert all(a >= b for a, b in zip(seen[10:], seen[11:]))


def test_schedule_state_round_trips():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = WarmupCosineLR(opt, warmup_steps=5, total_steps=50)
    lrs(sched, opt, 17)
    state = sched.state_dict()
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = WarmupCosineLR(opt2, warmup_steps=5, total_steps=999)
    sched2.load_state_dict(state)
    assert sched2.total_steps == 50 and sched2.last_epoch == sched.last_epoch
    sched.step(), sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_inverse_sqrt_matches_the_transformer_schedule():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=7e-4)
    sched = InverseSqrtLR(opt, warmup_steps=4, warmup_init_lr=0.0)
    seen = lrs(sched, opt, 17)
    assert seen[2] == pytest.approx(7e-4 * 2 / 4)
    assert seen[4] == pytest.approx(7e-4)
    assert seen[16] == pytest.approx(7e-4 * math.sqrt(4 / 16))


def test_every_torch_norm_layer_is_exempt_from_weight_decay():
    import inspect

    norms = {name for name, cls in vars(nn).items() if inspect.isclass(cls) and "Norm" in name}
    assert norms <= {cls.__name__ for cls in NORM_TYPES}, f"add {norms - {c.__name__ for c in NORM_TYPES}} to NORM_TYPES"
    layer_norm = nn.LayerNorm([4, 4])  # its weight is a matrix: decayed but for the norm rule
    assert len(param_groups(nn.Sequential(layer_norm))) == 2 and not param_groups(nn.Sequential(layer_norm))[0]["params"]


def test_schedule_arguments_leave_out_the_progress():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = WarmupCosineLR(optimizer, warmup_steps=3, total_steps=10, min_lr=0.01)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert schedule_arguments(schedule) == {"warmup_steps": 3, "total_steps": 10, "warmup_init_lr": 1e-6,
                                            "min_lr": 0.01, "base_lrs": [0.1]}
    assert schedule_arguments(InverseSqrtLR(optimizer, warmup_steps=5)).keys() == {
        "warmup_steps", "warmup_init_lr", "base_lrs"}


def test_param_groups_exempt_norms_biases_and_vectors():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(1, 4), nn.Conv2d(4, 4, 1, bias=False))
    net.register_parameter("token", nn.Parameter(torch.zeros(4)))
    decay, no_decay = param_groups(net)
    assert no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(net[0].weight), id(net[3].weight)}
    assert len(no_decay["params"]) == 1 + 2 + 2 + 1
    everything = param_groups(net, no_weight_decay_on_norm_bias=False)
    assert len(everything) == 1 and len(everything[0]["params"]) == len(list(net.parameters()))
