"""The trials warm each candidate up until its step time settles: no timed sample pays a first-call cost.

The first steps of a freshly built candidate pay one-time costs (the allocator growing, oneDNN creating its
primitives for a new layout, cuDNN autotuning): a trial step of timm's script took 3.75 s where the real run's
took 0.33 s. Here a model whose first forwards in channels_last sleep (a real ``time.sleep``, decaying as such
costs do) stands in for them: no timed sample of the channels_last candidate may be one of those calls. Each
call is logged, so the check reads which calls were timed, not how long they took (this shared machine's
timing noise reaches a step's length).
"""
import time

import torch
from torch.utils.data import DataLoader

import aiak
from aiak.cli.demo import DemoNet, synthetic_dataset
from aiak.strategy.select import resolve_strategy
from aiak.tune.candidates import candidate_strategies
from aiak.tune.trials import MIN_TIMED_ROUNDS, _build, _Rng, _timed_rounds, _warm_up

FIRST_CALLS_S = (0.8, 0.6, 0.4)  # the first forwards of a copy fed channels_last inputs


class SlowFirstLayoutCalls(DemoNet):
    logs = []  # per copy that saw channels_last: for each of its calls, whether it paid a first-call cost

    def __init__(self):
        super().__init__(width=8)
        self.log = []

    def forward(self, x):
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            if not self.log:
                SlowFirstLayoutCalls.logs.append(self.log)  # this copy's own list (deep copies get their own)
            slow = len(self.log) < len(FIRST_CALLS_S)
            if slow:
                time.sleep(FIRST_CALLS_S[len(self.log)])
            self.log.append(slow)
        return super().forward(x)


def setup():
    torch.manual_seed(0)
    model = SlowFirstLayoutCalls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic_dataset(48, image_size=16), batch_size=16)
    return model, optimizer, loader


def test_no_timed_sample_pays_a_first_call_cost():
    SlowFirstLayoutCalls.logs.clear()
    model, optimizer, loader = setup()
    strategy = {"extends": "default", "channels_last": True, "loader": {"prefetch": 2},
                "tune": {"candidates": 2, "steps": 3, "max_seconds": 60}}
    aiak.optimize(model, optimizer, loader, strategy=strategy)
    trials = aiak.last_decision().to_dict()["trials"]
    # 3 timed samples, or 2 where the ranking was clear in both rounds
    assert len(trials) == 2 and all(t["accepted"] and MIN_TIMED_ROUNDS <= len(t["samples_ms"]) <= 3
                                    for t in trials), trials
    layout = next(t for t in trials if t["strategy"].get("channels_last"))
    [log] = SlowFirstLayoutCalls.logs                              # one copy computed in channels_last ...
    assert log[:len(FIRST_CALLS_S)] == [True] * len(FIRST_CALLS_S)  # ... and paid its first-call costs ...
    timed = log[-len(layout["samples_ms"]):]
    assert not any(timed), log                                     # ... none of them in a timed step


def test_warm_up_stops_when_the_budget_is_spent():
    model, optimizer, loader = setup()
    batches = [b for b, _ in zip(loader, range(3))]
    strategy = {"extends": "default", "channels_last": True, "tune": {"candidates": 2, "steps": 3,
                                                                      "max_seconds": 1e-3}}
    selection = resolve_strategy(strategy, model, optimizer, loader)
    candidates = candidate_strategies(selection.strategy, selection.probes, limit=2, max_seconds=1e-3)
    contenders = _build(candidates, model, optimizer, torch.device("cpu"))
    _warm_up(contenders, batches, _Rng(loader), torch.device("cpu"))
    _timed_rounds(contenders, batches, selection.strategy.tune, time.perf_counter())
    for c in contenders:   # the gate step, then the fewest timed rounds: the budget is long spent
        assert len(c.warmup_s) == 1 and len(c.record.samples_ms) == MIN_TIMED_ROUNDS, c.candidate.label


class SleepyNet(DemoNet):
    """A step of a steady length (a sleep dominates it), longer by ``layout_s`` when fed channels_last."""

    def __init__(self, step_s, layout_s):
        super().__init__(width=8)
        self.step_s, self.layout_s = step_s, layout_s

    def forward(self, x):
        channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        time.sleep(self.step_s + (self.layout_s if channels_last else 0.0))
        return super().forward(x)


def test_steady_candidates_take_the_gate_step_and_the_timed_ones_only():
    """Steps that are steady from the start: the two after the gate's are settled, and they are the first
    timed samples (a separate warm-up made it five steps per candidate for two samples)."""
    candidates = build_candidates(step_s=0.15, layout_s=0.0, steps=2)
    for c in candidates:
        assert len(c.warmup_s) == 1 and len(c.record.samples_ms) == 2, (c.candidate.label, c.warmup_s)


def build_candidates(step_s, layout_s, steps):
    torch.manual_seed(0)
    model = SleepyNet(step_s, layout_s)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic_dataset(48, image_size=16), batch_size=16)
    batches = [b for b, _ in zip(loader, range(3))]
    strategy = {"extends": "default", "channels_last": True,
                "tune": {"candidates": 2, "steps": steps, "max_seconds": 60}}
    selection = resolve_strategy(strategy, model, optimizer, loader)
    candidates = candidate_strategies(selection.strategy, selection.probes, limit=2, max_seconds=60)
    contenders = _build(candidates, model, optimizer, torch.device("cpu"))
    _warm_up(contenders, batches, _Rng(loader), torch.device("cpu"))
    _timed_rounds(contenders, batches, selection.strategy.tune, time.perf_counter())
    return contenders


def test_a_clear_ranking_ends_the_rounds_and_a_close_one_uses_them_all():
    """A candidate slower than plain in every round by far more than noise (0.3 s more sleep on a 0.1 s step)
    ends the rounds at the fewest samples; two equal candidates take all ``tune.steps`` rounds."""
    clear = build_candidates(step_s=0.1, layout_s=0.3, steps=6)
    assert all(len(c.record.samples_ms) == MIN_TIMED_ROUNDS for c in clear), [c.record.samples_ms for c in clear]
    close = build_candidates(step_s=0.4, layout_s=0.0, steps=6)  # the sleep drowns any difference in compute
    assert all(len(c.record.samples_ms) == 6 for c in close), [c.record.samples_ms for c in close]
