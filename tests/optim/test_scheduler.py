"""A scheduler given to ``optimize()`` follows the LAMB/LARS optimizer swapped in for the user's one."""
import warnings

import pytest
import torch
from torch import nn

import aiak


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2))


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_steplr_drives_the_swapped_optimizer(name):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, new_opt, _, sched = aiak.optimize(model, opt, strategy={"optimizer": {"name": name}}, scheduler=sched)
    assert new_opt is not opt and type(new_opt).__name__.lower() == name
    assert len(new_opt.param_groups) > len(opt.param_groups)  # split into adapted / excluded groups
    assert sched.optimizer is new_opt
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden / called in the wrong order" warning
        for _ in range(2):
            nn.functional.cross_entropy(model(x), y).backward()
            new_opt.step()
            new_opt.zero_grad()
            sched.step()
    assert [g["lr"] for g in new_opt.param_groups] == [0.1] * len(new_opt.param_groups)


def test_lambdalr_per_group_lambdas_are_expanded_with_accumulation():
    model = _model()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 1.0},
                           {"params": list(model[1].parameters()) + list(model[2].parameters()), "lr": 2.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0 / (s + 1), lambda s: 1.0])
    model, new_opt, _, sched = aiak.optimize(
        model, opt, scheduler=sched, strategy={"optimizer": {"name": "lamb"}, "grad_accumulation": 2})
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    for _ in range(4):  # 2 real steps
        nn.functional.cross_entropy(model(x), y).backward()
        new_opt.step()
        new_opt.zero_grad()
        sched.step()
    first = {id(p) for p in model[0].parameters()}
    for g in new_opt.param_groups:
        from_first = id(g["params"][0]) in first
        assert g["lr"] == (1.0 / 3 if from_first else 2.0), (from_first, g["lr"])
