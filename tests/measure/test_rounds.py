"""aiak.measure.rounds: the round runner of demo and bench, and the statistics every printed figure comes from."""
import math
import statistics
import time

import pytest
import torch

from aiak.measure.rounds import (MIN_ROUNDS_FOR_VERDICT, Contender, Spread, alternate, median_interval, percentile,
                                 ranking_is_clear, speedup)
from aiak.measure.thresholds import SLOW_CONFIRMATIONS
from aiak.runtime.switches import read_switches, write_switches


def binomial_coverage(n, k):
    """P(s[k] <= median <= s[n-1-k]) for n samples of a continuous distribution, computed from the binomial."""
    below = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return 1 - 2 * below


def test_percentile_interpolates_between_ranks():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([0, 10], 10) == pytest.approx(1.0)
    assert percentile([5], 90) == 5
    with pytest.raises(ValueError):
        percentile([], 50)
    s = Spread.of([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (s.median, s.n) == (5.5, 10) and s.p10 == pytest.approx(1.9) and s.p90 == pytest.approx(9.1)


@pytest.mark.parametrize("n", [3, 6, 8, 10, 12, 20, 40])
def test_median_interval_is_the_widest_order_statistic_pair_reaching_99_percent(n):
    values = [float(v) for v in range(n)]
    low, high, coverage = median_interval(values)
    k = int(low)
    assert high == n - 1 - k and coverage == pytest.approx(binomial_coverage(n, k))
    # the next narrower pair would cover less than 99% (or there is none); this one covers >= 99% when n allows
    if k + 1 < n - 2 - k:
        assert binomial_coverage(n, k + 1) < 0.99
    assert coverage >= 0.99 or k == 0


@pytest.mark.parametrize("ratios, verdict", [
    ([1.5, 1.6, 1.55, 1.45, 1.52, 1.58, 1.49, 1.61, 1.5, 1.53], "faster"),
    ([0.5, 0.6, 0.55, 0.45, 0.52, 0.58, 0.49, 0.61, 0.5, 0.53], "slower"),
    ([0.95, 1.05, 1.0, 0.97, 1.08, 1.01, 0.99, 1.02, 1.0, 0.98], "within noise"),
    # every round but one faster: the min-max of 10 rounds (the 99.8% interval) still touches 1.0
    ([1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 1.3, 0.9], "within noise"),
    ([1.5, 1.6, 1.55, 1.45, 1.52], "too few rounds"),
    # a steady 1-2%, as two builds of the same plain model in one process can differ (aiak bench --strategy
    # default once read "1.01x faster (99.6% CI 1.00-1.02x)"): never called a speedup or a slowdown
    ([1.01, 1.012, 1.008, 1.011, 1.009, 1.015, 1.01, 1.02, 1.006, 1.01, 1.013, 1.01, 1.007, 1.011, 1.01, 1.009],
     "within noise"),
    ([0.99, 0.988, 0.992, 0.989, 0.991, 0.985, 0.99, 0.98, 0.994, 0.99, 0.987, 0.99, 0.993, 0.989, 0.99, 0.991],
     "within noise"),
    # the same steadiness 4% away is a speedup / slowdown
    ([1.04, 1.042, 1.038, 1.041, 1.039, 1.045, 1.04, 1.05, 1.036, 1.04, 1.043, 1.04, 1.037, 1.041, 1.04, 1.039],
     "faster"),
    ([0.96, 0.958, 0.962, 0.959, 0.961, 0.955, 0.96, 0.95, 0.964, 0.96, 0.957, 0.96, 0.963, 0.959, 0.96, 0.961],
     "slower"),
], ids=["faster", "slower", "noise", "one-slow-round", "few", "steady-1pct-up", "steady-1pct-down", "steady-4pct-up",
        "steady-4pct-down"])
def test_a_ratio_is_a_speedup_only_when_its_interval_is_on_one_side_of_one(ratios, verdict):
    s = speedup([1.0] * len(ratios), [1.0 / r for r in ratios])
    assert s.verdict == verdict
    assert s.median == pytest.approx(statistics.median(ratios))
    text = s.describe()
    assert text.startswith(f"{s.median:.2f}x")
    assert ("within noise" in text) == (verdict == "within noise")
    assert (f"{s.low:.2f}-{s.high:.2f}x" in text)
    # an interval clear of 1.00x that is still within noise says why
    assert ("never called a speedup" in text) == (verdict == "within noise" and (s.low > 1 or s.high < 1)), text
    assert s.to_dict()["verdict"] == verdict and s.to_dict()["rounds"] == len(ratios)
    assert len(ratios) >= MIN_ROUNDS_FOR_VERDICT or verdict == "too few rounds"


def test_an_interval_too_wide_to_tell_gives_no_ratio():
    # the rounds of a demo on a loaded machine once read "0.42x, within noise": a median of load, not of aiak
    ratios = [0.42, 0.2, 1.3, 0.35, 0.9, 0.42, 1.1, 0.25, 0.6, 0.42, 0.3, 1.2]
    s = speedup([1.0] * len(ratios), [1.0 / r for r in ratios])
    assert s.verdict == "within noise" and s.too_noisy
    text = s.describe()
    assert text.startswith("no verdict: the machine was too busy to tell") and not text.startswith("0.42x"), text
    assert f"{s.low:.2f}-{s.high:.2f}x" in text and "run it again on an idle machine" in text
    narrow = speedup([1.0] * 10, [1.0 / r for r in (0.95, 1.05, 1.0, 0.97, 1.08, 1.01, 0.99, 1.02, 1.0, 0.98)])
    assert not narrow.too_noisy and narrow.describe().startswith("1.00x, within noise")


def _sleeper(name, seconds, log):
    def step():
        log.append(name)
        time.sleep(seconds)
        return torch.tensor(float(len(log)), requires_grad=True) * 1.0  # a loss that requires grad, as in training
    return Contender(name, step)


def test_alternate_warms_up_in_turn_and_rotates_the_order_of_the_rounds():
    log = []
    a, b, c = (_sleeper(n, 0.001, log) for n in "abc")
    alternate([a, b, c], warmup=2, rounds=3, steps_per_round=2)
    assert log[:6] == list("abcabc")  # warm-up: one step each, in turn
    timed = log[6:]
    chunks = [timed[i] for i in range(0, len(timed), 2)]
    assert chunks == list("abc" "bca" "cab")  # each round starts one later
    for x in (a, b, c):
        assert x.steps == 2 + 3 * 2 and len(x.warmup_seconds) == 2 and len(x.step_seconds) == 6
        assert len(x.round_seconds) == 3 and sum(x.round_seconds) == pytest.approx(sum(x.step_seconds))
        assert all(t >= 0.001 for t in x.step_seconds) and x.stopped is None
        assert not math.isnan(x.loss) and isinstance(x.loss, float)


def test_a_contender_ten_times_slower_on_its_first_step_is_stopped_there():
    log = []
    base, ok, slow = _sleeper("base", 0.002, log), _sleeper("ok", 0.003, log), _sleeper("slow", 0.05, log)
    alternate([base, ok, slow], warmup=1, rounds=4, steps_per_round=3)
    assert slow.stopped is not None and "more than 10x the baseline" in slow.stopped
    timed = 1 + SLOW_CONFIRMATIONS   # judged on its first timed steps, the rounds' own: nobody runs more steps
    assert slow.steps == 1 + timed and slow.round_seconds == [] and len(slow.step_seconds) == timed
    assert ok.stopped is None and ok.steps == base.steps == 1 + 4 * 3
    assert log.count("slow") == 1 + timed  # its warm-up step and its first timed steps; it never ran again


def test_a_side_slow_on_every_step_it_ran_so_far_is_judged_again_before_it_is_stopped():
    # Under load every step a side has run can be slow: with one warm-up step, its warm-up and first timed step
    # both ten times the baseline's once stopped the plain strategy of a bench. The rule judges it again on its
    # next timed steps (the rounds' own, one a round here), and this side is fast on them.
    log = []
    durations = iter([0.06, 0.06] + [0.002] * 20)   # 1 warm-up step and the first timed one, then fast

    def spiky():
        log.append("spiky")
        time.sleep(next(durations))
        return 0.0

    base, candidate = _sleeper("base", 0.002, log), Contender("spiky", spiky)
    alternate([base, candidate], warmup=1, rounds=4, steps_per_round=1)
    assert candidate.stopped is None and len(candidate.round_seconds) == 4
    assert candidate.steps == base.steps == 1 + 4
    assert candidate.warmup_seconds[0] >= 0.06 and candidate.step_seconds[0] >= 0.06   # the spike was there


def _failing_at(name, step_number, log):
    def step():
        log.append(name)
        if log.count(name) == step_number:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return 0.0
    return Contender(name, step)


def test_with_catch_a_failing_contender_stops_with_its_error_and_the_others_go_on():
    log = []
    base, broken = _sleeper("base", 0.0, log), _failing_at("broken", 3, log)
    alternate([base, broken], warmup=1, rounds=4, steps_per_round=2, catch=True)
    assert broken.stopped == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert log.count("broken") == 3 and broken.steps == 2      # warm-up, round 0's first step, then the failure
    assert broken.step_seconds == [] and broken.round_seconds == []  # the round it failed in counts nothing
    assert base.stopped is None and base.steps == 1 + 4 * 2 and len(base.round_seconds) == 4
    with pytest.raises(RuntimeError, match="out of memory"):   # without catch the error is the caller's
        alternate([_sleeper("base", 0.0, []), _failing_at("broken", 1, [])], warmup=1, rounds=1, steps_per_round=1)


def test_until_ends_the_rounds_after_the_round_it_says_so_and_sees_that_rounds_figures():
    log, seen = [], []
    a, b = _sleeper("a", 0.001, log), _sleeper("b", 0.001, log)
    started = time.perf_counter() - 5.0   # the caller's clock started earlier: elapsed counts from there

    def until(rounds_done, elapsed):
        seen.append((rounds_done, len(a.step_seconds), len(b.round_seconds), elapsed))
        return rounds_done == 3

    alternate([a, b], warmup=0, rounds=10, steps_per_round=1, until=until, started=started)
    assert [s[:3] for s in seen] == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]
    assert all(e >= 5.0 for *_, e in seen) and [e for *_, e in seen] == sorted(e for *_, e in seen)
    assert log == list("ab" "ba" "ab")


def _two_ranks_disagree(rank, world):
    """On rank 1 only: ``steady`` takes 20 ms a step, ``slow`` 300 ms (over 10x the baseline's 10 ms) and
    ``broken`` fails on its second step; on rank 0 all three take no time and never fail."""
    def sleeping(name, on_rank1):
        return Contender(name, lambda: time.sleep(on_rank1 if rank == 1 else 0.0))
    base = Contender("base", lambda: time.sleep(0.01))
    steady, slow = sleeping("steady", 0.02), sleeping("slow", 0.3)
    broken = _failing_at("broken", 2, []) if rank == 1 else Contender("broken", lambda: 0.0)
    alternate([base, steady, slow, broken], warmup=1, rounds=3, steps_per_round=1, catch=True)
    return {c.name: (c.stopped, c.steps, c.step_seconds) for c in (base, steady, slow, broken)}


def test_across_ranks_every_rank_has_the_slowest_ranks_seconds_and_a_failure_anywhere_stops_everywhere():
    from tests.ranks import spawn_ranks

    r0, r1 = spawn_ranks(_two_ranks_disagree, world=2)
    for name in ("base", "steady", "slow"):
        assert r0[name] == r1[name], name                    # the same figures on every rank: rank 1's
    stopped, steps, seconds = r0["steady"]
    assert stopped is None and steps == 1 + 3 and len(seconds) == 3 and min(seconds) >= 0.02
    stopped, steps, seconds = r0["slow"]                       # stopped on rank 0, where it took no time
    assert "more than 10x the baseline" in stopped and steps == 1 + 1 + SLOW_CONFIRMATIONS
    assert len(seconds) == 1 + SLOW_CONFIRMATIONS and min(seconds) >= 0.3   # one step a round, 3 rounds
    assert r1["broken"][:2] == ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", 1)
    assert r0["broken"][:2] == ("failed on another rank", 2)  # rank 0 ran it too, then dropped it with rank 1
    assert r0["base"][0] is None and len(r0["base"][2]) == 3


def test_alternate_rejects_empty_or_impossible_plans():
    with pytest.raises(ValueError, match="at least one contender"):
        alternate([], warmup=1, rounds=1, steps_per_round=1)
    with pytest.raises(ValueError, match="rounds >= 1"):
        alternate([Contender("a", lambda: 0.0)], warmup=0, rounds=0, steps_per_round=1)


def test_each_contender_runs_under_its_own_process_switches():
    """``aiak.optimize`` sets process-wide switches (TF32, cuDNN autotuning): the plain side must not run under
    the strategy's. Each contender's steps see the switches taken when it was set up, whatever ran before; but
    glibc malloc's thresholds (`malloc_retain`), which are not switched between contenders: a process cannot return
    to glibc's own, and each run of steps would page its memory in again. Both see them as the strategy left them."""
    from aiak.runtime import malloc
    from aiak.runtime.switches import read_switches, write_switches

    before = read_switches()
    seen = {"plain": set(), "tuned": set()}
    try:
        torch.backends.cudnn.benchmark = False
        malloc.write(False)
        plain_switches = read_switches()
        torch.backends.cudnn.benchmark = True          # what a strategy with cudnn_benchmark: true leaves behind
        malloc.write(True)                              # ... and one with malloc_retain: true
        tuned_switches = read_switches()

        def stepper(name):
            def step():
                seen[name].add((torch.backends.cudnn.benchmark, malloc.read()))
                return 0.0
            return step

        alternate([Contender("plain", stepper("plain"), switches=plain_switches),
                   Contender("tuned", stepper("tuned"), switches=tuned_switches)],
                  warmup=2, rounds=3, steps_per_round=2)
    finally:
        write_switches(before)
    assert seen == {"plain": {(False, True)}, "tuned": {(True, True)}}


@pytest.mark.parametrize("total, rounds, warmup, window, plan", [
    (200, 20, 5, 1, (20, 9)),     # aiak demo's default: 180 timed steps, the 20 left over warm up
    (32, 8, 2, 2, (16, 2)),       # an example with accumulation 2: every round holds whole windows
    (25, 20, 5, 1, (5, 1)),
])
def test_plan_rounds_uses_every_step_in_whole_windows(total, rounds, warmup, window, plan):
    from aiak.measure.rounds import plan_rounds

    got = plan_rounds(total, rounds, warmup, window)
    assert got == plan and got[0] + rounds * got[1] == total and got[1] % window == 0 and got[0] >= warmup


def test_plan_rounds_refuses_too_few_steps():
    from aiak.measure.rounds import plan_rounds

    with pytest.raises(ValueError, match="24 steps are fewer than 5 warm-up \\+ 20 rounds x 1"):
        plan_rounds(24, 20, 5)


def test_a_contender_that_reports_its_own_seconds_is_timed_by_them_not_by_the_clock():
    """Work timed in other processes (aiak.comm.allreduce.env_trials): the parent's clock would count its waiting too."""
    reported = iter([5.0, 1.0, 2.0, 3.0])
    waited = Contender("children", lambda: next(reported), reports_seconds=True)
    alternate([waited], warmup=1, rounds=3, steps_per_round=1, across_ranks=False)
    assert waited.warmup_seconds == [5.0] and waited.step_seconds == [1.0, 2.0, 3.0]
    assert math.isnan(waited.loss)


def test_a_switch_a_contender_changes_in_its_own_steps_stays_its_own():
    """A contender's steps that change a process switch (the run-time guard sets the threads of its windows) keep
    it in that contender's later rounds, and the other contender still runs under its own."""
    before = read_switches()
    seen = {"a": [], "b": []}

    def step_a():
        seen["a"].append(torch.get_num_threads())
        if len(seen["a"]) == 2:
            torch.set_num_threads(1)
        return 0.0

    def step_b():
        seen["b"].append(torch.get_num_threads())
        return 0.0

    a = Contender("a", step_a, switches={**before, "num_threads": 2})
    b = Contender("b", step_b, switches={**before, "num_threads": 2})
    try:
        alternate([a, b], warmup=0, rounds=4, steps_per_round=2)
    finally:
        write_switches(before)
    assert seen["a"] == [2, 2, 1, 1, 1, 1, 1, 1] and seen["b"] == [2] * 8


@pytest.mark.parametrize("ratios, clear", [
    ([[1.5, 1.6], [0.5, 0.6]], True),          # one faster in every round, one slower in every round
    ([[1.5, 1.01]], False),                    # within noise of the baseline in one round
    ([[1.5, 1.6], [1.4, 1.7]], False),         # two faster ones, the best not ahead in every round
    ([[1.5, 1.8], [1.4, 1.7]], True),          # ... ahead in every round (though not beyond the other's best round)
    ([[0.5, 0.6], [0.8, 0.7]], True),          # every one slower than the baseline
])
def test_the_ranking_is_clear_when_more_rounds_would_not_change_it(ratios, clear):
    """The one rule the trials' rounds and the run-time guard's windows stop on."""
    assert ranking_is_clear(ratios) is clear
