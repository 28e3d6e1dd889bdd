"""aiak with Hugging Face Accelerate, in both orders (issue 14): ``aiak.optimize`` then ``accelerator.prepare``, and
``prepare`` then ``aiak.optimize`` (an ``AcceleratedOptimizer`` given to aiak). CPU, a tiny MLP.

Every loop is Accelerate's documented one: ``with accelerator.accumulate(model)``, ``accelerator.backward``,
``accelerator.clip_grad_norm_`` when ``sync_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``.
"""
import warnings

import pytest
import torch
from torch import nn

import aiak
from aiak.amp.half_compute import half_compute_of

accelerate = pytest.importorskip("accelerate")

from tests.integrations.conftest import aiak_warnings, max_abs_diff, tensors  # noqa: E402

ORDERS = ["aiak-then-prepare", "prepare-then-aiak"]
CLIP = 0.5


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def _train(order, strategy, *, batch=8, gas=1, clip=CLIP):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=gas)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if order == "aiak-then-prepare":
        if strategy is not None:
            model, opt, _ = aiak.optimize(model, opt, strategy=strategy)
        model, opt = accelerator.prepare(model, opt)
    else:
        model, opt = accelerator.prepare(model, opt)
        if strategy is not None:
            model, opt, returned = aiak.optimize(model, opt, strategy=strategy)
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer)
    x, y = tensors(64)
    for xs, ys in zip(x.split(batch), y.split(batch)):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(xs), ys))
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, opt


def _plain(batch=8, clip=CLIP):
    return _train("aiak-then-prepare", None, batch=batch, clip=clip)[0]


@pytest.mark.parametrize("order", ORDERS)
def test_grad_accumulation_with_clipping_equals_a_bigger_batch(order):
    """aiak accumulating 2 batches of 4, clipped by accelerator.clip_grad_norm_ at 0.5, equals plain Accelerate on
    batches of 8 with the same clip (1e-6); the clip is active (without it the weights differ)."""
    model, opt = _train(order, {"grad_accumulation": 2}, batch=4)
    assert opt.optimizer._aiak_steps.accumulation == 2
    assert max_abs_diff(model, _plain()) < 1e-6
    assert max_abs_diff(_plain(clip=None), _plain()) > 1e-3


@pytest.mark.parametrize("order", ORDERS)
def test_accumulate_stacked_with_aiaks_warns_once_and_accelerates_wins(order):
    """Accelerator(gradient_accumulation_steps=2) + accumulate() + aiak's grad_accumulation: 2: one warning, and the
    run is 2-batch accumulation (equal to batches of 8, 1e-6), not 4."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, _ = _train(order, {"grad_accumulation": 2}, batch=4, gas=2)
    said = aiak_warnings(record)
    assert len(said) == 1 and "Accelerator(gradient_accumulation_steps) = 2" in said[0], said
    assert max_abs_diff(model, _plain()) < 1e-6


@pytest.mark.parametrize("order", ORDERS)
def test_o2_bf16_with_clip_grad_norm(order):
    """O2 bf16: equal to aiak O2 in a plain loop with torch's clip (bit for bit), within bf16's resolution (2e-2)
    of fp32 Accelerate (so bf16 really computed), the parameters left fp32."""
    strategy = {"precision": {"level": "O2", "dtype": "bf16"}}
    model, _ = _train(order, strategy)
    net = _net()
    net, opt, _ = aiak.optimize(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9), strategy=strategy)
    x, y = tensors(64)
    for xs, ys in zip(x.split(8), y.split(8)):
        nn.functional.cross_entropy(net(xs), ys).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    assert model[0].weight.dtype == torch.float32
    for a, b in zip(model.state_dict().values(), net.state_dict().values()):
        assert torch.equal(a, b)
    assert 1e-4 < max_abs_diff(model, _plain()) < 2e-2


def test_a_failed_optimize_on_a_prepared_optimizer_leaves_everything_as_it_was(monkeypatch):
    """All or nothing through the wrapper: a failure after the O2 cast puts back the fp32 model and the optimizer
    inside the AcceleratedOptimizer (no step controller, its own step, its param groups on the model)."""
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.5))
    opt.optimizer.param_groups[0]["params"] = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner_step = opt.optimizer.step

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in distributed wrapping")

    monkeypatch.setattr(aiak.comm, "wrap_distributed", fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        aiak.optimize(model, opt, strategy={"grad_accumulation": 2, "precision": {"level": "O2", "dtype": "bf16"}})
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert not hasattr(opt.optimizer, "_aiak_steps") and opt.optimizer.step == inner_step
    assert opt.optimizer.param_groups[0]["params"] == list(model.parameters())


def test_the_prepare_adapter_equals_optimize_then_prepare_by_hand():
    """aiak.integrations.accelerate.prepare (with a scheduler and a loader): bit-identical weights to calling
    aiak.optimize then accelerator.prepare by hand; the scheduler advanced once per real step."""
    from aiak.integrations.accelerate import prepare

    strategy = {"grad_accumulation": 2, "precision": {"level": "O2", "dtype": "bf16"}}
    x, y = tensors(64)
    results = []
    for use_adapter in (True, False):
        accelerator = accelerate.Accelerator(cpu=True)
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
        if use_adapter:
            model, opt, loader, sched = prepare(accelerator, model, opt, loader, strategy=strategy, scheduler=sched)
        else:
            model, opt, _, sched = aiak.optimize(model, opt, strategy=strategy, scheduler=sched)
            model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        for xs, ys in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(xs), ys))
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
        results.append((model, sched))
    (adapted, adapted_sched), (by_hand, _) = results
    assert adapted[0].weight.dtype == torch.float32 and half_compute_of(adapted) is not None
    for a, b in zip(adapted.state_dict().values(), by_hand.state_dict().values()):
        assert torch.equal(a, b)
    assert adapted_sched.scheduler.last_epoch == 8  # 16 batches, 8 real steps


def test_aiak_imports_no_framework():
    """``import aiak`` and ``aiak.optimize`` import no framework and no adapter (they are imported lazily)."""
    import subprocess
    import sys

    code = ("import sys, torch, aiak\n"
            "m = torch.nn.Linear(2, 2)\n"
            "aiak.optimize(m, torch.optim.SGD(m.parameters(), lr=0.1), strategy={'grad_accumulation': 2})\n"
            "bad = [n for n in ('pytorch_lightning', 'lightning', 'accelerate', 'transformers',\n"
            "       'aiak.integrations.lightning', 'aiak.integrations.transformers', 'aiak.integrations.accelerate')\n"
            "       if n in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
