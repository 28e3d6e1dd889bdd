"""A learning-rate scheduler advances once per real optimizer step under aiak's gradient accumulation, whether it
was given to ``optimize(scheduler=...)`` or built on the returned optimizer afterwards, and stays the user's
class (picklable with ``torch.save``)."""
import io
import pickle

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

import aiak


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model, opt, sched, micro_steps):
    x, y = torch.randn(4, 6), torch.randint(0, 2, (4,))
    rates = []
    for _ in range(micro_steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
    return rates


SCHEDULES = {
    "step": lambda opt: L.StepLR(opt, step_size=1, gamma=0.5),
    "cosine": lambda opt: L.CosineAnnealingLR(opt, T_max=5),
    "warmup+cosine": lambda opt: L.SequentialLR(
        opt, [L.LinearLR(opt, start_factor=0.1, total_iters=2), L.CosineAnnealingLR(opt, T_max=4)], milestones=[2]),
    "restarts": lambda opt: L.CosineAnnealingWarmRestarts(opt, T_0=2),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_scheduler_built_after_optimize_follows_real_steps(name):
    """Built on the returned optimizer (as a script that creates its scheduler after the aiak line does), it once
    advanced on every micro-step: lr 0.00039 instead of 0.025 after 2 real steps with accumulation 4."""
    model = _model()
    model, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  strategy={"grad_accumulation": 4})
    got = _train(model, opt, SCHEDULES[name](opt), 12)
    reference_opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    reference = SCHEDULES[name](reference_opt)
    want = []
    for _ in range(3):  # 3 real steps: the rate holds through each window and moves after its last micro-step
        reference_opt.step()
        reference.step()
        want += [reference_opt.param_groups[0]["lr"]] * 4
    assert got[3::4] == pytest.approx(want[3::4], rel=1e-12), (got, want)
    assert got[:3] == pytest.approx([0.1 if name != "warmup+cosine" else 0.01] * 3), got  # micro-steps: no move


def test_the_scheduler_given_to_optimize_keeps_its_class_and_pickles():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _, sched = aiak.optimize(model, opt, strategy={"grad_accumulation": 2},
                                         scheduler=L.StepLR(opt, step_size=1, gamma=0.5))
    assert type(sched) is L.StepLR
    _train(model, opt, sched, 4)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    pickle.loads(pickle.dumps(sched))  # the object itself, as torch.save(scheduler) pickles it
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_a_scheduler_of_an_optimizer_aiak_did_not_touch_steps_every_call():
    """Patched classes gate only schedulers of an optimizer aiak steps: any other advances on every call."""
    stepped_by_aiak = _model()
    aiak.optimize(stepped_by_aiak, torch.optim.SGD(stepped_by_aiak.parameters(), lr=0.1),
                  strategy={"grad_accumulation": 4})
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rates = _train(model, opt, L.StepLR(opt, step_size=1, gamma=0.5), 3)
    assert rates == pytest.approx([0.05, 0.025, 0.0125])


def test_a_scheduler_built_before_optimize_but_not_given_to_it_follows_real_steps_too():
    """The optimizer is patched in place, so a scheduler the script built on it earlier is gated from its first
    step after ``optimize()`` on."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = L.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": 2})
    assert _train(model, opt, sched, 4) == pytest.approx([0.1, 0.05, 0.05, 0.025])
