"""Process switches do not leak between trial candidates: every step runs under its own candidate's switches.

A candidate with TF32 and cuDNN autotuning on must not leave them on for the next one timed, least of all for
plain PyTorch, whose gradients are the numerics gate's fp32 reference. This CPU has no TF32: a device that says
it has TF32 tensor cores stands in (the switches are written as on CUDA; the CPU's kernels ignore them).
"""
import time

import pytest
import torch
from torch import nn

from aiak.util.machine import devices
from aiak.runtime.rollback import Snapshot
from aiak.strategy.select import resolve_strategy
from aiak.tune.candidates import candidate_strategies
from aiak.tune.trials import MIN_TIMED_ROUNDS, _build, _Rng, _timed_rounds, _warm_up

CPU = torch.device("cpu")


def process_switches():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


class SwitchSpy(nn.Module):
    """Records the process switches each forward runs under (per copy: every candidate has its own)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(process_switches())
        return self.linear(x)


@pytest.fixture
def switches_off():
    """Every switch off to start with, and put back afterwards."""
    snapshot = Snapshot()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    yield
    snapshot.restore()


def test_each_candidate_steps_under_its_own_switches(switches_off, monkeypatch):
    torch.manual_seed(0)
    model = SwitchSpy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(3)]
    strategy = {"extends": "default", "tf32": True, "cudnn_benchmark": True, "tune": {"candidates": 3, "steps": 3}}
    selection = resolve_strategy(strategy, model, optimizer, batches)
    candidates = candidate_strategies(selection.strategy, selection.probes, limit=3, max_seconds=None)
    monkeypatch.setattr(devices, "cuda_capability", lambda device: (8, 0))  # "this device has TF32 tensor cores"
    contenders = _build(candidates, model, optimizer, CPU)
    assert process_switches() == (False, False, False)        # building a candidate leaves the process as it was

    _warm_up(contenders, batches, _Rng(batches, cuda=False), CPU)
    cfg = selection.strategy.tune
    _timed_rounds(contenders, batches, cfg, time.perf_counter())

    seen = {c.candidate.label: c.bare.seen for c in contenders}
    expected = {"plain": (False, False, False),                 # the fp32 reference: no TF32, no autotuning
                "neutral": (False, False, True),                # cuDNN autotuning only (numerics-neutral)
                selection.strategy.name: (True, True, True)}    # the pick: both
    assert set(seen) == set(expected)
    for label, values in seen.items():
        assert len(values) >= 1 + 2 and set(values) == {expected[label]}, (label, values)
    assert all(len(c.record.samples_ms) >= MIN_TIMED_ROUNDS for c in contenders)  # timed rounds among them
