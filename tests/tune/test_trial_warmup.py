"""The trials warm each candidate up until its step time settles: no timed sample pays a first-call cost; they end
the rounds when more would not change the decision.

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
from aiak.tune.trials import MIN_TIMED_ROUNDS, WARMUP_MAX_STEPS, _build, _Rng, _Stopping, _timed_rounds, _warm_up

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
                "tune": {"candidates": 2, "steps": 3, "max_seconds": 60, "guard": False}}  # rounds on copies
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


def rounds_until_done(series, steps, max_seconds=60.0, seconds_per_round=0.01):
    """Feed :class:`_Stopping` the given step times one round at a time, as the trials do (each list: the gate's
    step, then one per round); the rounds it took and where timing started."""
    rules = _Stopping(steps, max_seconds)
    for n in range(2, len(next(iter(series.values()))) + 1):
        if rules.done({label: s[:n] for label, s in series.items()}, elapsed=n * seconds_per_round):
            return n - 1, rules.timed_from
    raise AssertionError("the rules never stopped")


def test_steady_candidates_take_the_gate_step_and_the_timed_ones_only():
    """Steps that are steady from the start: the two after the gate's are settled, and they are the first
    timed samples (a separate warm-up made it five steps per candidate for two samples)."""
    steady = {"plain": [0.15] * 10, "channels_last": [0.15] * 10}
    assert rounds_until_done(steady, steps=2) == (2, 1)


def test_timing_starts_once_the_first_call_costs_are_spent_or_at_the_latest_step():
    decaying = {"plain": [0.1] * 12, "channels_last": [0.9, 0.7, 0.5, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]}
    rounds, timed_from = rounds_until_done(decaying, steps=3)
    assert timed_from == 4 and decaying["channels_last"][timed_from] == 0.1 and rounds == timed_from + 3 - 1
    never = {"plain": [0.1] * 12, "channels_last": [0.9 * 0.7 ** k for k in range(12)]}  # 30% faster every step
    assert rounds_until_done(never, steps=3)[1] == WARMUP_MAX_STEPS - MIN_TIMED_ROUNDS


def test_a_clear_ranking_ends_the_rounds_and_a_close_one_uses_them_all():
    """A candidate slower than plain in every round by far more than noise ends the rounds at the fewest
    samples; one within :data:`NOISE_FLOOR` of plain in some round takes all ``tune.steps`` rounds."""
    clear = {"plain": [0.1] * 10, "channels_last": [0.4] * 10}
    assert rounds_until_done(clear, steps=6) == (2, 1)
    close = {"plain": [0.4] * 10, "channels_last": [0.4, 0.4, 0.41, 0.39, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]}
    assert rounds_until_done(close, steps=6) == (6, 1)
    # two faster candidates, the best not ahead of the other in every round: not clear either
    tied = {"plain": [0.4] * 10, "a": [0.2, 0.2, 0.25] + [0.2] * 7, "b": [0.22] * 10}
    assert rounds_until_done(tied, steps=6) == (6, 1)
    ahead = {"plain": [0.4] * 10, "a": [0.2] * 10, "b": [0.3] * 10}
    assert rounds_until_done(ahead, steps=6) == (2, 1)


def test_the_default_budget_is_five_percent_of_a_200_step_run_at_plains_speed():
    slow = {"plain": [0.1] * 12, "channels_last": [0.9 * 0.7 ** k for k in range(12)]}  # never settles
    # 5% of 200 steps x 0.1 s = 1 s: at 0.22 s a round, the fourth would end past it, so three are run
    assert rounds_until_done(slow, steps=6, max_seconds=None, seconds_per_round=0.22) == (3, 2)
    # plain at 0.2 s a step: 2 s, eight rounds (timing from the sixth step, the latest warm-up allows)
    slow["plain"] = [0.2] * 12
    assert rounds_until_done(slow, steps=6, max_seconds=None, seconds_per_round=0.22) == (8, 4)
    assert _Stopping(6, None).budget({"channels_last": [0.1]}) is None  # no plain, no default budget
