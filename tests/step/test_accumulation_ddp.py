"""Accumulation under DDP (2 gloo ranks): gradients are allreduced only on the last micro-step."""
import functools

import pytest
import torch
from torch import nn

from tests.ranks import spawn_ranks

N_ACC, MICRO, STEPS = 4, 4, 8  # STEPS micro-steps per rank = 2 real steps


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(rank, world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, world, MICRO, 6, generator=g)
    y = torch.randint(0, 2, (STEPS, world, MICRO), generator=g)
    return x, y


def _worker(rank, world, accumulation):
    import aiak
    from torch.profiler import profile

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": accumulation})
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    x, y = _data(rank, world)
    with profile() as prof:
        for step in range(STEPS):
            nn.functional.cross_entropy(model(x[step, rank]), y[step, rank]).backward()
            opt.step()
            opt.zero_grad()
    allreduces = sum(e.name == "gloo:all_reduce" for e in prof.events())
    return allreduces, model.state_dict()


def _launch(accumulation, world=2):
    return dict(enumerate(spawn_ranks(functools.partial(_worker, accumulation=accumulation), world)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_allreduce_only_on_the_last_micro_step_and_same_result_as_big_batch():
    with_acc = _launch(N_ACC)
    without = _launch(1)
    counts = {r: n for r, (n, _) in with_acc.items()}
    assert counts == {0: STEPS // N_ACC, 1: STEPS // N_ACC}, counts       # one bucket, 2 real steps
    assert {r: n for r, (n, _) in without.items()} == {0: STEPS, 1: STEPS}
    sd0, sd1 = with_acc[0][1], with_acc[1][1]
    assert list(sd0) == list(_model().state_dict())                         # the user's keys, no "module."
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k                                 # every rank ends identical
    # reference: one process, each real step on the concatenation of all ranks' micro-batches
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = _data(0, 2)
    for s in range(0, STEPS, N_ACC):
        xs = x[s:s + N_ACC].reshape(-1, 6)
        ys = y[s:s + N_ACC].reshape(-1)
        nn.functional.cross_entropy(ref(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd0[k], v, rtol=1e-5, atol=1e-6)
