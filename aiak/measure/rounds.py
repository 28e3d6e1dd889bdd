"""Figures a user can trust: contenders alternate in rounds, both warm up, and a ratio comes with its spread.

On a shared machine the same training step has measured 63 ms and 488 ms minutes apart. Running the baseline
once and then the candidate once measures the machine's drift as much as the candidate: ``aiak demo
--strategy default`` (plain PyTorch by another name) read 1.10x and 1.74x that way. So:

- every contender warms up first (allocator, caches, lazy inits, compilation), in alternation;
- the timed steps are cut into rounds; in each round every contender runs its share back to back, the order
  rotating from round to round, so a slow minute costs every contender alike;
- the speedup is taken **per round** (baseline time / candidate time in the same round, which cancels the
  drift between rounds), and reported as the median of the rounds with its distribution-free 99%
  confidence interval (order statistics; no assumption on the shape of the machine's noise);
- it is called a speedup (or a slowdown) only when that whole interval is on one side of 1.00x and the median
  is more than `NOISE_FLOOR` (3%) from it; otherwise the figure is "within
  noise". The interval alone is not enough: two builds of the same plain model in one process differ by a
  percent or so (where their memory landed), and with quiet rounds the interval is narrow enough to call that
  a speedup: ``aiak bench --strategy default`` read "1.01x faster (99.6% CI 1.00-1.02x)" in one run of six.
  With fewer than `MIN_ROUNDS_FOR_VERDICT` rounds the interval is too loose to judge by, and the
  verdict says so.

`alternate` is the one round runner: ``aiak demo``, ``aiak bench``, the comm autotuner
(`aiak.comm.allreduce.autotune`) and the auto-selector's trials (`aiak.tune.trials`, which bring their own
stop rules through ``until``).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from aiak.measure.clock import StepClock
from aiak.measure.thresholds import (MIN_ROUNDS_FOR_VERDICT, NOISE_FLOOR, NOISY_SPREAD, SLOW_CONFIRMATIONS,
                                     SLOW_FACTOR)
from aiak.runtime.switches import MEMORY_SWITCHES, read_switches, write_switches
from aiak.util.dist import max_across_ranks
from aiak.util.text import describe_error

__all__ = ["Spread", "Speedup", "Contender", "alternate", "percentile", "median_interval", "speedup", "plan_rounds", "MIN_ROUNDS_FOR_VERDICT",
           "SLOW_FACTOR", "NOISY_SPREAD", "NOISE_FLOOR"]



def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between the closest ranks."""
    s = sorted(values)
    if not s:
        raise ValueError("percentile of no values")
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """The median of some samples with their p10 and p90."""

    median: float
    p10: float
    p90: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(statistics.median(values), percentile(values, 10), percentile(values, 90), len(values))

    def scaled(self, factor: float) -> "Spread":
        return Spread(self.median * factor, self.p10 * factor, self.p90 * factor, self.n)


def ranking_is_clear(ratios: Sequence[Sequence[float]]) -> bool:
    """Whether more rounds would not change a choice among contenders, each given by its per-round speed ratios to
    the same baseline (the baseline's seconds over its own, round by round): every one faster than the baseline by
    more than `NOISE_FLOOR` in every round or slower in every one, and the fastest (by the median) faster than each
    other faster one in every round. The trials' rounds on copies and the run-time guard's windows stop on it."""
    if any(min(r) <= 1 + NOISE_FLOOR and max(r) >= 1 / (1 + NOISE_FLOOR) for r in ratios):
        return False   # within noise of the baseline in some round
    faster = [r for r in ratios if min(r) > 1]
    best = max(faster, key=statistics.median, default=None)
    return all(all(a > b for a, b in zip(best, r)) for r in faster if r is not best)


def median_interval(values: Sequence[float], level: float = 0.99) -> Tuple[float, float, float]:
    """The distribution-free confidence interval of the median from order statistics: ``(low, high,
    coverage)`` = ``(s[k], s[n-1-k], 1 - 2 P(Binomial(n, 1/2) <= k))`` for the largest ``k`` whose coverage
    is at least ``level`` (k = 0, the min-max, when even that covers less; the coverage says how much)."""
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("interval of no values")

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n

    k = 0
    while k + 1 < n - 1 - (k + 1) and coverage(k + 1) >= level:
        k += 1
    return s[k], s[n - 1 - k], max(coverage(k), 0.0)


@dataclass(frozen=True)
class Speedup:
    """Baseline time / candidate time, one ratio per round: the median, its confidence interval, and what they
    allow (`verdict`)."""

    median: float
    low: float
    high: float
    coverage: float     # of [low, high]: 0.99 from 8 rounds on, 0.97-0.98 with 6-7 (min-max)
    rounds: int

    @property
    def verdict(self) -> str:
        """"faster" or "slower" when the whole interval is on one side of 1.0 and the median is more than
        `NOISE_FLOOR` from it, else "within noise" (or "too few rounds" below `MIN_ROUNDS_FOR_VERDICT`,
        whose min-max covers the median less than 95%)."""
        if self.rounds < MIN_ROUNDS_FOR_VERDICT:
            return "too few rounds"
        if self.low > 1.0 and self.median > 1.0 + NOISE_FLOOR:
            return "faster"
        if self.high < 1.0 and self.median < 1.0 / (1.0 + NOISE_FLOOR):
            return "slower"
        return "within noise"

    @property
    def too_noisy(self) -> bool:
        """Within noise with an interval wider than `NOISY_SPREAD` (high / low): the machine's load, not
        the strategies, decided the rounds, and no ratio is worth printing."""
        return self.verdict == "within noise" and self.high > NOISY_SPREAD * self.low

    def describe(self) -> str:
        """E.g. ``1.52x faster (99% CI 1.41-1.60x, 10 rounds)``, ``1.01x, within noise (...)``, or no ratio at all
        when the rounds were `too_noisy`."""
        spread = f"{self.coverage * 100:.1f}% CI {self.low:.2f}-{self.high:.2f}x, {self.rounds} rounds"
        if self.verdict == "too few rounds":
            return (f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f}x over {self.rounds} rounds: too few to "
                    f"tell a speedup from noise, use {MIN_ROUNDS_FOR_VERDICT} or more)")
        if self.too_noisy:
            return (f"no verdict: the machine was too busy to tell (the rounds' ratios span {self.low:.2f}-"
                    f"{self.high:.2f}x, {self.coverage * 100:.1f}% CI over {self.rounds} rounds, so their median "
                    f"{self.median:.2f}x means nothing); run it again on an idle machine")
        if self.verdict == "within noise":
            if self.low > 1.0 or self.high < 1.0:       # a steady difference, but one identical setups show too
                spread += f"; closer than {NOISE_FLOOR:.0%} to 1.00x is never called a speedup"
            return f"{self.median:.2f}x, within noise ({spread})"
        return f"{self.median:.2f}x {self.verdict} ({spread})"

    def to_dict(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high, "coverage": self.coverage,
                "rounds": self.rounds, "verdict": self.verdict}


def speedup(baseline_rounds: Sequence[float], candidate_rounds: Sequence[float]) -> Speedup:
    """Per-round ratios ``baseline / candidate`` over the rounds both completed."""
    ratios = [b / c for b, c in zip(baseline_rounds, candidate_rounds) if c > 0]
    if not ratios:
        raise ValueError("no completed round to compare")
    low, high, coverage = median_interval(ratios)
    return Speedup(statistics.median(ratios), low, high, coverage, len(ratios))


@dataclass
class Contender:
    """One side of a comparison: ``step()`` runs one training step on ``device`` and returns its loss.

    ``switches`` (`aiak.runtime.switches.read_switches`, taken right after the contender was set up) are put in
    place before each of its runs of steps: ``aiak.optimize`` sets process-wide settings (TF32, cuDNN
    autotuning, threads) that would otherwise speed up, or change the numerics of, the plain side too. Not the
    memory switches (`aiak.runtime.switches.MEMORY_SWITCHES`: glibc malloc's thresholds, ``malloc_retain``): a
    process cannot return to glibc's own once they were fixed, and switching them between runs of steps would make
    each run page its memory in again. Every contender of one process runs with them as they are, so a speedup
    timed here leaves their gain out; ``benchmarks/separate_processes.py`` times it in processes of their
    own. After each
    run of steps they are read again: what the contender's own steps changed (the run-time guard,
    `aiak.tune.guard`, sets the threads of its windows) stays its own.

    `alternate` fills ``step_seconds`` (every timed step, in order), ``round_seconds`` (the sum of its
    steps in each round), ``steps`` (all steps run, warm-up included) and ``loss`` (the last loss, a float); a
    contender stopped early has ``stopped`` set to the reason. With ``reports_seconds``, ``step()`` returns the
    seconds it measured itself instead of a loss (work timed in other processes, `aiak.comm.allreduce.env_trials`):
    they replace the clock's, which would count the waiting for those processes too.
    """

    name: str
    step: Callable[[], object]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    switches: Optional[dict] = None
    step_seconds: List[float] = field(default_factory=list)
    round_seconds: List[float] = field(default_factory=list)
    warmup_seconds: List[float] = field(default_factory=list)
    steps: int = 0
    loss: float = float("nan")
    stopped: Optional[str] = None
    reports_seconds: bool = False

    def timing(self) -> Spread:
        return Spread.of(self.step_seconds)


Progress = Callable[[Contender, int, int], None]   # (contender, its steps so far, its steps in all)
Until = Callable[[int, float], bool]                 # (rounds done, seconds since ``started``) -> stop now


def _run(c: Contender, n: int, total: int, progress: Optional[Progress], catch: bool) -> List[float]:
    """``n`` steps of ``c``, each timed on its device's clock (CUDA events, read once at the end). With ``catch``
    a step that raises stops ``c`` (``stopped`` says why, `aiak.util.text.describe_error`) and ends the
    run, whose last entry is then ``inf``."""
    if c.switches is not None:   # but the memory switches: every contender computes with them as they are
        write_switches({k: v for k, v in c.switches.items() if k not in MEMORY_SWITCHES})
    clock = StepClock(c.device)
    marks = [clock.mark()]
    loss, reported = None, []
    for _ in range(n):
        try:
            loss = c.step()
        except Exception as e:  # noqa: BLE001 - error or OOM: the contender stops, on every rank (see _agree)
            if not catch:
                raise
            c.stopped = describe_error(e)
            break
        marks.append(clock.mark())
        if c.reports_seconds:
            reported.append(float(loss))
            loss = None
        c.steps += 1
        if progress is not None:
            progress(c, c.steps, total)
    if c.switches is not None:  # as its own steps left them (a run-time guard may change threads mid-run)
        c.switches = read_switches()
    if loss is not None:
        c.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    seconds = reported if c.reports_seconds else [clock.seconds(a, b) for a, b in zip(marks, marks[1:])]
    return seconds + [math.inf] if c.stopped is not None and len(seconds) < n else seconds


def plan_rounds(total_steps: int, rounds: int, warmup: int, multiple_of: int = 1) -> Tuple[int, int]:
    """``(warmup, steps_per_round)`` that use every one of ``total_steps``: ``rounds`` rounds of a multiple of
    ``multiple_of`` steps (a whole accumulation window, so every round holds the same number of optimizer
    steps), the steps left over added to the warm-up. ``ValueError`` when fewer than ``warmup + rounds *
    multiple_of`` steps leave no round of one window."""
    per_round = (total_steps - warmup) // rounds // multiple_of * multiple_of
    if per_round < 1:
        raise ValueError(f"{total_steps} steps are fewer than {warmup} warm-up + {rounds} rounds x {multiple_of}")
    return total_steps - rounds * per_round, per_round


def _agree(ran: Dict[int, List[float]], order: Sequence[Contender], width: int, elapsed: float,
           across_ranks: bool, group) -> Tuple[Dict[int, List[float]], float]:
    """The slowest rank's seconds of every step each contender of ``order`` ran (``width`` slots each, one
    collective for all, with the seconds since ``started``): a synchronous step is as slow as its slowest rank,
    and a step that failed anywhere (``inf``) stops its contender on every rank."""
    packed = []
    for c in order:
        seconds = ran.get(id(c), [])
        packed += seconds + [0.0] * (width - len(seconds))
    reduced = max_across_ranks(packed + [elapsed], group) if across_ranks else packed + [elapsed]
    agreed = {}
    for i, c in enumerate(order):
        seconds = reduced[i * width:i * width + len(ran.get(id(c), []))]
        if any(math.isinf(t) for t in reduced[i * width:(i + 1) * width]):
            c.stopped = c.stopped or "failed on another rank"
            continue
        agreed[id(c)] = seconds
    return agreed, reduced[-1]


def alternate(contenders: Sequence[Contender], *, warmup: int, rounds: int, steps_per_round: int,
              progress: Optional[Progress] = None, slow_factor: float = SLOW_FACTOR,
              across_ranks: bool = True, group=None, catch: bool = False, until: Optional[Until] = None,
              started: Optional[float] = None) -> None:
    """Warm every contender up, then time up to ``rounds`` rounds of ``steps_per_round`` steps each.

    The first contender is the baseline. Warm-up alternates one step at a time. In round ``r`` the order is
    rotated by ``r``, so nobody always runs first. A contender whose fastest step stays more than
    ``slow_factor`` times the baseline's over its first few timed steps stops there (``stopped`` says why;
    `_judge_slow`; its warm-up did not make it faster, so more steps would only cost the user minutes): ``aiak
    bench --strategy cnn`` once ran ten minutes at 0.03x before printing anything.

    ``catch``: a step that raises stops its contender (``stopped``: the error) instead of propagating; the
    others go on. ``until(rounds_done, elapsed)``, called after every round with every contender's figures of
    that round in place and the seconds since ``started`` (a ``time.perf_counter()`` reading, by default this
    call's start), ends the rounds early when it returns True: the auto-selector's trials stop when their
    warm-up has settled and the ranking is clear, or their budget is spent (`aiak.tune.trials`).

    Under ``torch.distributed`` every rank must call this with the same contenders: every step's seconds
    (warm-up and rounds) are the slowest rank's, a failure on any rank stops the contender on all, and the
    slow stop is decided on those figures (collectives on ``group``, torch's default group when None), so
    ``until`` sees the same figures on every rank. ``across_ranks=False`` keeps everything local, for a run on
    one rank alone (``aiak bench``'s single-worker measurement while the other ranks wait).
    """
    if not contenders:
        raise ValueError("alternate() needs at least one contender")
    if warmup < 0 or rounds < 1 or steps_per_round < 1:
        raise ValueError(f"need warmup >= 0, rounds >= 1, steps_per_round >= 1; got {warmup}, {rounds}, "
                         f"{steps_per_round}")
    started = time.perf_counter() if started is None else started
    total = warmup + rounds * steps_per_round
    baseline = contenders[0]
    for _ in range(warmup):
        running = [c for c in contenders if c.stopped is None]
        ran = {id(c): _run(c, 1, total, progress, catch) for c in running}
        agreed, _ = _agree(ran, running, 1, time.perf_counter() - started, across_ranks, group)
        for c in running:
            c.warmup_seconds += agreed.get(id(c), [])
    active = [c for c in contenders if c.stopped is None]
    judged = {id(baseline)} | ({id(c) for c in contenders} if math.isinf(slow_factor) else set())
    for r in range(rounds):
        shift = r % len(active)
        order = active[shift:] + active[:shift]
        ran: Dict[int, List[float]] = {}
        for c in order:
            seconds: List[float] = []
            while id(c) not in judged and len(seconds) < steps_per_round and (r > 0 or id(baseline) in ran):
                seconds += _run(c, 1, total, progress, catch)    # a step at a time until the 10x rule has judged c
                if _judge_slow(c, baseline, ran.get(id(baseline), []), seconds, slow_factor, across_ranks, group):
                    judged.add(id(c))
            if c.stopped is None:
                seconds += _run(c, steps_per_round - len(seconds), total, progress, catch)
            ran[id(c)] = seconds
        agreed, elapsed = _agree(ran, order, steps_per_round, time.perf_counter() - started, across_ranks, group)
        for c in order:
            if id(c) in agreed:
                c.step_seconds += agreed[id(c)]
                if c.stopped is None:
                    c.round_seconds.append(sum(agreed[id(c)]))
        active = [c for c in active if c.stopped is None]
        if not active or (until is not None and until(r + 1, elapsed)):
            break


def _judge_slow(c: Contender, baseline: Contender, theirs_now: List[float], mine_now: List[float],
                slow_factor: float, across_ranks: bool, group) -> bool:
    """The 10x rule, after each of ``c``'s first timed steps: True once it has judged ``c``, which is either
    within ``slow_factor`` of the baseline or stopped (``stopped`` says why).

    Each side is judged by its fastest step so far, warm-up included: one step of a loaded machine can take 40x
    its usual time (58 ms and 2557 ms, one after the other, on this project's 2-core machine), and a compiling
    strategy's slow first steps lose to its later ones. A side slower than ``slow_factor`` times the baseline
    is stopped only when it still is after ``1 + SLOW_CONFIRMATIONS`` timed steps: a loaded machine can make
    every step a side has run slow (a bench under load once stopped the plain `default` strategy, whose one
    warm-up step and first timed step took 63 ms against the baseline's 5.9 ms), while a strategy ten times
    slower than plain costs only those steps more. The steps are the rounds' own, so every contender still
    runs as many. By the slowest rank's figures (``theirs_now``, ``mine_now``: this round's steps so far); a
    failure on any rank (``inf``) ends the judging on every rank, so the collectives match."""
    mine_all = c.warmup_seconds + c.step_seconds + mine_now
    figures = [min(baseline.warmup_seconds + baseline.step_seconds + theirs_now, default=math.inf),
               min(mine_all, default=math.inf), float(any(math.isinf(t) for t in mine_now))]
    theirs, mine, failed = max_across_ranks(figures, group) if across_ranks else figures
    if failed or math.isinf(mine):                     # a failure: _agree stops c on every rank
        return True
    if mine <= slow_factor * theirs:
        return True
    timed = len(c.step_seconds) + len(mine_now)
    if timed < 1 + SLOW_CONFIRMATIONS:
        return False
    c.stopped = (f"stopped after its first {timed} timed steps: the fastest step it ran took {mine * 1e3:.1f} ms, "
                 f"more than {slow_factor:g}x the baseline's {theirs * 1e3:.1f} ms")
    return True
