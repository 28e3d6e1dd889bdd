"""The numerics gate judges a candidate's gradient error against the gradient's own sampling noise.

bf16 (O1 and O2) passes on real models at random init, where its gradient cosine against fp32 is far below any
fixed bound that would still catch a broken candidate; broken gradients (built from real fp32 gradients: permuted,
doubled, a layer's gradient dropped, garbage added, an overflowing fp16 loss scale) fail.
"""
import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import aiak
from aiak.util import warn as amp_warn
from aiak.strategy.select import resolve_strategy
from aiak.tune import gate
from aiak.tune.candidates import candidate_strategies
from aiak.tune.trials import _build, _Rng, _warm_up

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

BATCH = 8
MODELS = {
    "timm_resnet18": lambda: timm.create_model("resnet18", num_classes=10),
    "timm_mobilenetv3": lambda: timm.create_model("mobilenetv3_small_050", num_classes=10),
    "timm_vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8),
    "torchvision_resnet18": lambda: torchvision.models.resnet18(num_classes=10),
}


def fp32_gradients(model, x, y):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return gate.gradients(model)


def batches(seed=0, n=BATCH):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(2)]


@functools.lru_cache(maxsize=None)
def reference(name):
    """A fresh model, plain fp32's gradients on batch 0 and their sampling noise (from batch 1, as the trials);
    computed once per model (callers build new dicts, never edit these)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    (x0, y0), (x1, y1) = batches()
    g = fp32_gradients(copy.deepcopy(model), x0, y0)
    noise = gate.sampling_noise(g, fp32_gradients(copy.deepcopy(model), x1, y1), BATCH, BATCH, BATCH)
    return model, g, noise


def half_gradients(model, precision):
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with amp_warn.quiet():  # emulated half precision on this CPU: said once by optimize(), not here
        m, _, _ = aiak.optimize(m, opt, None, strategy={"extends": "default", "precision": precision, "tune": False})
    x, y = batches()[0]
    return fp32_gradients(m, x, y)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_passes_the_gate_on_real_models(name):
    model, g, noise = reference(name)
    for level in ("O1", "O2"):
        result = gate.compare(half_gradients(model, {"level": level, "dtype": "bf16"}), g, noise)
        assert result.passed, (name, level, result.why())


def _permuted(g):
    gen = torch.Generator().manual_seed(1)
    return {k: v.reshape(-1)[torch.randperm(v.numel(), generator=gen)].reshape(v.shape) for k, v in g.items()}


def _garbage(g, noise):
    """fp32's gradient plus random values of twice its sampling noise (a kernel computing wrong values)."""
    gen = torch.Generator().manual_seed(2)
    junk = {k: torch.randn(v.shape, generator=gen) for k, v in g.items()}
    size = math.sqrt(sum(float(v.square().sum()) for v in junk.values()))
    return {k: v + junk[k] * (2 * noise / size) for k, v in g.items()}


def _dropped(g):
    """The largest weight's gradient missing, as a layer whose gradient never reached its parameter."""
    name = max((k for k in g if g[k].any()), key=lambda k: g[k].numel())
    return {k: torch.zeros_like(v) if k == name else v for k, v in g.items()}


def _dropped_small(g):
    """A small layer's gradient missing (too small to move the whole gradient's error or scale)."""
    name = min((k for k in g if g[k].any()), key=lambda k: g[k].norm())
    return {k: torch.zeros_like(v) if k == name else v for k, v in g.items()}


BROKEN = {
    "permuted": (_permuted, "scale"),
    "doubled": (lambda g: {k: 2 * v for k, v in g.items()}, "scale"),
    "sign": (lambda g: {k: -v for k, v in g.items()}, "scale"),
    "garbage": (None, "sampling noise"),
    "dropped_layer": (_dropped, "lost"),
    "dropped_small_layer": (_dropped_small, "lost"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_broken_gradients_fail(broken):
    _, g, noise = reference("timm_resnet18")
    make, reason = BROKEN[broken]
    candidate = _garbage(g, noise) if make is None else make(g)
    result = gate.compare(candidate, g, noise)
    assert not result.passed and reason in result.why(), result.why()


def test_an_overflowing_fp16_loss_scale_fails():
    model, g, noise = reference("timm_mobilenetv3")
    result = gate.compare(half_gradients(model, {"level": "O2", "dtype": "fp16", "loss_scale": 1e30}), g, noise)
    assert not result.finite and not result.passed and "inf or NaN" in result.why()


def test_sampling_noise_matches_the_noise_of_a_mean():
    """Per-sample gradients N(mu, I) in 20000 dimensions: a 16-sample mean's noise has norm sqrt(20000 / 16)."""
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(20000, generator=gen)
    samples = mu + torch.randn(32, 20000, generator=gen)
    batch_a, batch_b = {"w": samples[:16].mean(0)}, {"w": samples[16:].mean(0)}
    half_a, half_b = {"w": samples[:8].mean(0)}, {"w": samples[8:16].mean(0)}
    uneven_a, uneven_b = {"w": samples[:5].mean(0)}, {"w": samples[5:16].mean(0)}
    expected = math.sqrt(20000 / 16)
    assert gate.sampling_noise(batch_a, batch_b, 16, 16, 16) == pytest.approx(expected, rel=0.03)
    assert gate.sampling_noise(half_a, half_b, 8, 8, 16) == pytest.approx(expected, rel=0.03)
    assert gate.sampling_noise(uneven_a, uneven_b, 5, 11, 16) == pytest.approx(expected, rel=0.03)


def test_bf16_candidate_is_accepted_by_the_trials_on_mobilenetv3():
    torch.manual_seed(0)
    model = MODELS["timm_mobilenetv3"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.cat([b[0] for b in batches()])
    y = torch.cat([b[1] for b in batches()])
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"},
                "tune": {"candidates": 2, "steps": 2, "max_seconds": 1}}   # bf16 and plain, few steps
    aiak.optimize(model, optimizer, loader, strategy=strategy)
    trials = aiak.last_decision().to_dict()["trials"]
    [bf16] = [t for t in trials if t["strategy"].get("precision.level") == "O1"]
    assert bf16["accepted"] and "sampling noise" in bf16["why"], bf16["why"]


class CountingNet(nn.Module):
    """Counts its training forward calls (per copy: each trial candidate has its own; the evaluation forward
    each candidate takes after its gate step is not one)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        return self.net(x)


@pytest.mark.parametrize("strategy,n_batches,extra", [
    ({"precision": {"level": "O1", "dtype": "bf16"}}, 2, 1),    # one more batch's gradient
    ({"precision": {"level": "O1", "dtype": "bf16"}}, 1, 2),    # one batch: its two halves
    ({"channels_last": True}, 2, 0),                             # every candidate numerics-neutral: no gate
])
def test_plain_takes_the_noise_passes_only_when_a_candidate_needs_the_gate(strategy, n_batches, extra):
    torch.manual_seed(0)
    model = CountingNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))) for _ in range(n_batches)]
    strategy = {"extends": "default", "tune": {"candidates": 3, "steps": n_batches}, **strategy}
    selection = resolve_strategy(strategy, model, optimizer, data)
    candidates = candidate_strategies(selection.strategy, selection.probes, limit=3, max_seconds=None)
    contenders = _build(candidates, model, optimizer, torch.device("cpu"))
    _warm_up(contenders, data, _Rng(data, cuda=False), torch.device("cpu"))
    calls = {c.candidate.label: c.bare.calls for c in contenders}
    others = [n for label, n in calls.items() if label != "plain"]
    assert others and all(n == 1 for n in others), calls          # the gate step
    assert calls["plain"] == 1 + extra, calls
    gated = [c for c in contenders if c.candidate.label != "plain" and not c.candidate.neutral]
    assert len(gated) == (2 if extra else 0)
    assert all(not c.failed and "sampling noise" in c.record.why for c in gated), [c.record.why for c in gated]


def test_the_noise_passes_leave_plain_as_it_was():
    """Plain's step controller (the pick's 2-step accumulation) sees one backward before its first step, not
    three (several would read as the script accumulating itself, and it would give way), and its BatchNorm
    counted one batch."""
    from aiak.cli.demo import DemoNet

    torch.manual_seed(0)
    model = DemoNet(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,)))]   # one batch: its two halves
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "grad_accumulation": 2,
                "tune": {"candidates": 2, "steps": 1}}
    selection = resolve_strategy(strategy, model, optimizer, data)
    candidates = candidate_strategies(selection.strategy, selection.probes, limit=2, max_seconds=None)
    contenders = _build(candidates, model, optimizer, torch.device("cpu"))
    _warm_up(contenders, data, _Rng(data, cuda=False), torch.device("cpu"))
    plain = next(c for c in contenders if c.candidate.label == "plain")
    assert not any(c.failed for c in contenders), [c.record.why for c in contenders]
    assert plain.controller is not None and plain.controller.accumulation == 2
    bn = plain.bare.features[0][1]
    assert int(bn.num_batches_tracked) == 1
