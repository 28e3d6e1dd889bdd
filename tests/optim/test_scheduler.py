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


@pytest.mark.parametrize("make", [
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6),
    lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4),   # a warm-up: lr < base
], ids=["cosine", "warmup"])
def test_a_learning_rate_set_in_the_strategy_is_the_base_of_the_users_schedule(make):
    """``optimizer: {name: lars, lr: 0.7}`` with the user's SGD(0.1) scheduler: LARS runs the user's schedule
    around 0.7, as a scheduler built on LARS(0.7) would. (It once ran at the SGD's rate, 0.1, while the
    decision record said 0.7.)"""
    def schedule(opt, sched, steps):
        rates = []
        for _ in range(steps):
            rates.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return rates

    model = _model()
    user = torch.optim.SGD(model.parameters(), lr=0.1)
    model, lars, _, sched = aiak.optimize(model, user, strategy={"optimizer": {"name": "lars", "lr": 0.7}},
                                          scheduler=make(user))
    got = schedule(lars, sched, 6)
    reference_opt = torch.optim.SGD(_model().parameters(), lr=0.7)
    want = schedule(reference_opt, make(reference_opt), 6)
    assert got == pytest.approx(want, rel=1e-6), (got, want)
    assert all(g["lr"] == lars.param_groups[0]["lr"] for g in lars.param_groups)  # every split group alike


def test_without_a_strategy_rate_the_swapped_optimizer_keeps_the_users_schedule_mid_run():
    model = _model()
    user = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(user, T_max=6)
    for _ in range(2):
        user.step()
        sched.step()
    now = user.param_groups[0]["lr"]
    model, lamb, _, sched = aiak.optimize(model, user, strategy={"optimizer": {"name": "lamb"}}, scheduler=sched)
    assert [g["lr"] for g in lamb.param_groups] == pytest.approx([now] * len(lamb.param_groups))
    assert sched.base_lrs == pytest.approx([0.1] * len(lamb.param_groups))


def test_one_cycle_keeps_its_own_rates_and_says_the_strategy_rate_is_unused():
    """OneCycleLR takes its rates from max_lr, not from the optimizer: built on LARS(0.7) it would run the same."""
    model = _model()
    user = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(user, max_lr=0.1, total_steps=8)
    reference_opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    reference = torch.optim.lr_scheduler.OneCycleLR(reference_opt, max_lr=0.1, total_steps=8)
    with pytest.warns(UserWarning, match="OneCycleLR sets the rates from its own max_lr"):
        model, lars, _, sched = aiak.optimize(model, user, strategy={"optimizer": {"name": "lars", "lr": 0.7}},
                                              scheduler=sched)
    for _ in range(5):
        assert lars.param_groups[0]["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"])
        lars.step()
        sched.step()
        reference_opt.step()
        reference.step()


@pytest.mark.parametrize("groups", [1, 2])
def test_torchvisions_warm_up_then_cosine_drives_the_swapped_optimizer(groups):
    """torchvision's ``--lr-warmup-epochs``: ``SequentialLR([LinearLR, CosineAnnealingLR], milestones=[2])`` on the
    user's SGD(0.1), LAMB(1e-3) swapped in by the strategy. Every LAMB group follows the warm-up and the cosine
    around 1e-3, as the same SequentialLR built on LAMB would (rel 1e-6). The schedulers inside are re-pointed
    too; once, ``_milestones`` was "expanded" to [2, 2] with one group (IndexError at the milestone), and with two
    groups LAMB's rate stayed 0.001 while the schedule moved."""
    def warm_up_then_cosine(opt):
        return torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)], milestones=[2])

    def rates(opt, sched, steps=8):
        seen = []
        for _ in range(steps):
            seen.append([g["lr"] for g in opt.param_groups])
            opt.step()
            sched.step()
        return seen

    def param_groups(model):
        return ([{"params": model.parameters()}] if groups == 1 else
                [{"params": model[0].parameters()}, {"params": list(model[1].parameters()) + list(model[2].parameters())}])

    model = _model()
    user = torch.optim.SGD(param_groups(model), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "the epoch parameter in scheduler.step() was not necessary" etc.
        model, lamb, _, sched = aiak.optimize(model, user, strategy={"optimizer": {"name": "lamb", "lr": 1e-3}},
                                              scheduler=warm_up_then_cosine(user))
        got = rates(lamb, sched)
        reference = torch.optim.SGD(_model().parameters(), lr=1e-3)
        want = [row[0] for row in rates(reference, warm_up_then_cosine(reference))]
    assert all(s.optimizer is lamb for s in sched._schedulers) and sched.optimizer is lamb
    for row, expected in zip(got, want):
        assert row == pytest.approx([expected] * len(row), rel=1e-6), (got, want)
    assert len({round(r[0], 12) for r in got}) > 4  # the schedule really moved
