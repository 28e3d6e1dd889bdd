"""``aiak.optimize``: the contract (order of returned objects, default == plain PyTorch, logging)."""
import copy
import logging
import warnings
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import aiak
from aiak.cli.demo import DemoNet, synthetic_dataset


def _loop(model, opt, loader, epochs=2):
    for _ in range(epochs):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_default_strategy_reproduces_plain_training_bit_for_bit(opt_cls):
    def setup():
        torch.manual_seed(0)
        model = DemoNet(width=8)
        opt = opt_cls(model.parameters(), lr=0.01)
        loader = DataLoader(synthetic_dataset(64, image_size=8), batch_size=16, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        return model, opt, loader

    plain = _loop(*setup())
    model, opt, loader = setup()
    model2, opt2, loader2 = aiak.optimize(model, opt, loader, strategy="default")
    assert (model2, opt2, loader2) == (model, opt, loader)  # same objects back, nothing to wrap
    trained = _loop(model2, opt2, loader2)
    for (k, a), b in zip(plain.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), k


def test_returns_the_callers_order_and_the_scheduler_when_given():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    out = aiak.optimize(model, opt, None, strategy="default", scheduler=sched)
    assert len(out) == 4 and out[0] is model and out[1] is opt and out[2] is None and out[3] is sched
    assert len(aiak.optimize(nn.Linear(2, 2), strategy="default")) == 3


def test_optimize_logs_a_one_screen_summary(caplog):
    caplog.set_level(logging.INFO, logger="aiak")
    model = DemoNet(width=8)
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  strategy={"precision": {"level": "O2", "dtype": "bf16"}, "grad_accumulation": 2})
    text = caplog.text
    assert "aiak.optimize: strategy 'custom'" in text
    assert "O2 bf16" in text and "half compute copies of the fp32 parameters" in text
    assert "optimizer steps every 2 step() calls" in text
    assert len(text.splitlines()) < 40


def test_auto_says_what_it_detected(caplog):
    from aiak.util.machine.cpu import has_native_bf16_cpu

    caplog.set_level(logging.INFO, logger="aiak")
    model = DemoNet(width=8)
    loader = DataLoader(synthetic_dataset(32, image_size=8), batch_size=8)
    strategy, reasons = aiak.select_strategy(model, None, loader)
    assert strategy.name == "auto" and strategy.channels_last and "channels_last" in reasons["channels_last"]
    assert (strategy.precision.level == "O1") == has_native_bf16_cpu()   # bf16 only where the CPU has it
    assert strategy.precision.dtype == "bf16" and "loader.prefetch" in reasons
    aiak.optimize(model, None, loader)
    assert "strategy 'auto'" in caplog.text and "rules matched: auto_base" in caplog.text


def test_bad_strategy_fails_before_touching_anything():
    model = DemoNet(width=8)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(aiak.StrategyError, match="precision.level"):
        aiak.optimize(model, strategy={"precision": {"level": "O9"}})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_import_aiak_imports_no_optional_dependency_and_never_touches_cuda():
    code = ("import sys, torch\n"
            "calls = []\n"
            "torch.cuda.init = lambda *a, **k: calls.append('init')\n"
            "torch.cuda._lazy_init = lambda *a, **k: calls.append('lazy_init')\n"
            "import aiak\n"
            "aiak.optimize, aiak.Strategy, aiak.load_strategy, aiak.ops, aiak.loaders, aiak.comm, aiak.optim, aiak.amp\n"
            "bad = [m for m in ('triton', 'nvidia.dali', 'apex', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "assert not calls, calls\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_auto_changes_the_math_only_through_a_gated_candidate():
    """auto may turn on bf16 only after its gradients matched fp32's on the user's batch; whatever it picks,
    training reaches plain PyTorch's loss (4 epochs of the demo model: within 5%, measured gap < 1%)."""
    def setup():
        torch.manual_seed(0)
        model = DemoNet(width=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(synthetic_dataset(256, image_size=8), batch_size=16, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        return model, opt, loader

    def final_loss(model, opt, loader):
        for _ in range(4):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return float(loss.detach())

    plain = final_loss(*setup())
    model, opt, loader = aiak.optimize(*setup())  # strategy="auto"
    decision = aiak.last_decision().to_dict()
    # every candidate that may compute the run's steps (the trials' choice, or each one the guard times in the run)
    # and changes the precision passed the gate
    half = [t for t in decision["trials"] if t["accepted"] and t["strategy"].get("precision.level", "O0") != "O0"]
    assert all("numerics gate passes" in t["why"] for t in half), half
    if decision["strategy"]["precision"]["level"] != "O0":
        assert half
    assert abs(final_loss(model, opt, loader) - plain) <= 0.05 * plain + 0.02


def test_a_second_optimize_of_a_model_with_other_model_knobs_names_them():
    """A model optimized once keeps its model-level knobs: a second call asking for others is refused, naming
    them, and changes nothing (the hooks would otherwise apply twice)."""
    model = DemoNet(width=8)
    aiak.optimize(model, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    hooks = len(model._forward_pre_hooks)
    with pytest.raises(ValueError, match="differs in precision.*strategy='auto'"):
        aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="default")
    assert len(model._forward_pre_hooks) == hooks


def test_tune_without_an_optimizer_and_loader_says_why_and_applies_the_pick():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aiak.optimize(nn.Linear(2, 2), strategy={"tune": True})
    decision = aiak.last_decision().to_dict()
    assert decision["trials"] == [] and "need a model, an optimizer and a loader" in decision["tuning"]
