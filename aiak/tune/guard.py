"""The run-time guard: a measured pick that runs slower than plain PyTorch in the real run gives way to plain compute.

The trials (`aiak.tune.trials`) time the candidates on the first batches, under the machine's load of that moment.
A shared machine's load changes, and it hurts some configurations much more than plain PyTorch: with two busy
processes beside the demo model on a 2-core CPU, its bf16 O1 steps took 53 ms at the median but 570 ms at the 90th
percentile (plain fp32: 104 ms and 187 ms), because oneDNN's bf16 convolution backward slowed from 8.9 ms a call on
one intra-op thread to 44 ms on two, where fp32's took 18.8 ms either way (torch.profiler; `aiak.util.machine.load`;
measured while aiak's prefetch thread still kept an OpenMP team of its own, `aiak.util.background_threads`). A median
hides such a tail; the run pays for it.

So after `aiak.optimize()` applies a measured pick, the run's first real steps alternate windows of the arms below,
each step timed from its first training forward to the end of its optimizer step (forward, backward and step, as the
script runs them; what runs between an optimizer step and the next training forward is not counted: the loading, the
same for every arm, an evaluation, or another run's steps when `aiak bench` and the demo alternate two runs):

* `pick`: the strategy as applied;
* `pick, N threads`: the same with the intra-op threads cut to the cores other work leaves free, offered only when
  the machine is busier than torch's thread count allows (`aiak.util.machine.load`);
* the trials' other accepted candidates that differ from the pick only in what switches exactly between two steps
  (`aiak.tune.trials` hands them over instead of timing them on copies): the precision level
  (`HalfCompute.switch_level`), half compute off, the channels_last layout off (`aiak.runtime.switches.ChannelsLast`),
  the fused window attention or the 1x1 convolutions as matrix multiplies off (`aiak.ops.surgery.FusedOpsSwitch`);
* `plain compute`: the model's half-precision regions off (`aiak.amp.half_compute.HalfCompute.enabled`: the
  parameters are fp32 either way), its weights and inputs in the contiguous layout where the pick made them
  channels_last, the modules it swapped (window attention, 1x1 convolutions) computing with their original forward,
  and the process switches
  (threads, TF32, cuDNN autotuning) as the script had them before `optimize()`: plain PyTorch's compute, exactly.
  The optimizer steps as applied in every arm: torch's fused step (`optimizer.fused`, `aiak.optim.fused_step`) is
  the same update whatever the compute, and stays; so do glibc malloc's thresholds (`malloc_retain`,
  `aiak.runtime.switches.MEMORY_SWITCHES`), which change how memory is obtained, not what is computed.

Each window is `TIMED_STEPS` timed steps, after one untimed step where the window switched the compute (the switch's
own cost: a layout change copies every 4-D weight and optimizer state, and an arm's first steps create kernels). The
order runs forwards in even rounds and backwards in odd ones, so the arm that ends a round begins the next with no
switch, and an arm of the other layout (plain compute, against a channels_last pick) changes it once a round. Each
arm's speedup is plain's seconds over its own, summed over the rounds (a sum, not a median: a tail of slow steps is
what the run pays). The guard stops after `MAX_ROUNDS` rounds, or after `MIN_ROUNDS` where more would not change its
choice (each arm faster than plain beyond `NOISE_FLOOR` in every round or slower in every one, and the fastest ahead of
the others in every round; or the chosen arm, plain compute or one ahead of it beyond `NOISE_FLOOR` in every round,
still chosen were each other arm to run every round left as far ahead of plain as in its best round so far, and the
chosen one as far behind as in its worst); from `MIN_ROUNDS` on, an arm slower than plain in every round and slower than
another arm in every round is no longer timed. The fastest arm is chosen, unless a preferred one is within the
noise of both (half the range of their per-round ratios, at least `NOISE_FLOOR`): the pick where the trials timed it
already (so the thread budget replaces it only beyond noise), plain compute and then the simpler candidates where the
guard is their only timing. The promise comes first: where the chosen arm took longer in sum than plain beyond
`NOISE_FLOOR` (a wide spread of the rounds is no reason to keep it), the rest of the run computes as plain PyTorch.
A change is said in one line on stderr, beside `optimize()`'s own. The decision record (`aiak.last_decision()`) shows
the guard's figures, and the tuning cache learns its choice beside the load it was measured under
(`aiak.tune.trials`).

What the guard cannot switch between two steps is left as applied: other fused modules (the language-model head),
the loader's prefetching, fp16 (its loss scaling). A model the pick left contiguous gets a `ChannelsLast`, off, where
an arm computes channels_last (`aiak.runtime.switches.attach_layout`); it is detached again unless the chosen arm
computes so. The guard does not run under `torch.compile` (switching the compute would recompile), with fp8 layers
(swapped modules), on several ranks (each rank would choose alone), or where the trials chose plain compute.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from aiak.amp.half_compute import HalfCompute
from aiak.measure.clock import StepClock
from aiak.measure.rounds import ranking_is_clear
from aiak.measure.thresholds import NOISE_FLOOR
from aiak.ops.surgery import FusedOpsSwitch
from aiak.runtime.switches import attach_layout, channels_last_of, read_switches, with_memory_switches, write_switches
from aiak.util.dist import is_distributed
from aiak.util.machine.load import CpuLoad, cpu_load
from aiak.util.warn import is_rank_zero

TIMED_STEPS = 2    # timed steps per window, after an untimed one where the window switched the compute
MIN_ROUNDS = 2     # rounds before the guard may stop early ...
MAX_ROUNDS = 4     # ... and at most

PICK, BUDGET, PLAIN = "pick", "pick, fewer threads", "plain compute"


@dataclass
class Arm:
    """One way the run may compute: the process switches it writes, whether the half-precision regions run and at
    which level (`aiak.amp.half_compute.HalfCompute.switch_level`; None: the pick's), whether the weights and
    inputs are channels_last (`aiak.runtime.switches.ChannelsLast`; None: the pick's), and which of the fused ops the
    pick applied compute swapped (`aiak.ops.surgery.FusedOpsSwitch`; None: the pick's)."""

    label: str
    switches: Dict[str, Any]
    half_compute: bool
    level: Optional[str] = None
    channels_last: Optional[bool] = None
    fused_ops: Optional[FrozenSet[str]] = None   # the switched fused ops on (`FusedOpsSwitch`); None: the pick's
    seconds: List[float] = field(default_factory=list)   # per round: its window's timed steps, summed


@dataclass
class GuardResult:
    """What the guard measured and chose; `to_dict()` is the decision record's `guard`."""

    chosen: str
    speedups: Dict[str, float]            # arm -> plain's seconds / its seconds, over every round
    rounds: Dict[str, List[float]]        # arm -> its per-round ratio to plain
    steps: int                            # the real steps the guard watched
    load: Dict[str, Any]                  # the machine's load when it began (`CpuLoad.to_dict`)
    threads: Dict[str, int]               # arm -> its intra-op threads
    why: str

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


class SpeedGuard:
    """Watches a run's first real steps through an optimizer step hook (see the module docstring).

    Args:
        optimizer: the optimizer whose `step()` ends each real step (the one `optimize()` returned, unwrapped).
        model: the model whose first training forward after an optimizer step starts the next step's clock.
        compute: the model's half-precision regions (`HalfCompute`), or None without them.
        pick_switches: the process switches as the pick applied them (`aiak.runtime.switches.read_switches`).
        plain_switches: the process switches as the script had them before `optimize()`.
        load: the machine's load now; a thread budget is offered when it leaves fewer cores than the pick's threads.
        device: where the model computes (the clock: host time on CPU, CUDA events on a GPU).
        on_decision: called once with the `GuardResult`.
        others: more arms the trials accepted (`aiak.tune.trials`: candidates that differ from the pick only in
            what switches between steps), timed beside the pick, in order of preference; one the model cannot
            switch to exactly (`HalfCompute.level_switchable`, a layout it was not given) is left out.
        prefer: the labels chosen over a faster arm within noise of it, in order (`choose`): by default the pick
            (the trials timed it faster already); the trials' simpler candidates first where the guard is their
            only timing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, compute: Optional[HalfCompute],
                 pick_switches: Dict[str, Any], plain_switches: Dict[str, Any], load: CpuLoad,
                 device: torch.device, on_decision: Callable[[GuardResult], None], *,
                 others: Sequence[Arm] = (), prefer: Sequence[str] = (PICK,)):
        self.model, self.optimizer, self.compute = model, optimizer, compute
        self.load, self.on_decision = load, on_decision
        self.layout, self.attached = channels_last_of(model), None
        if self.layout is None and any(arm.channels_last for arm in others):   # a model the pick left contiguous
            self.layout, self.attached = attach_layout(model)
        self.pick_level = compute.level if compute is not None else None   # as applied
        self.pick_layout = self.layout.on if self.layout is not None else None
        self.fused = FusedOpsSwitch(model)     # the modules the pick swapped (none: switching does nothing)
        self.prefer = list(prefer)
        self.arms = [Arm(PICK, dict(pick_switches), True)]
        threads = pick_switches.get("num_threads", torch.get_num_threads())
        if load.free_cores < threads:
            self.arms.append(Arm(BUDGET, {**pick_switches, "num_threads": load.free_cores}, True))
        self.arms += [arm for arm in others if self._reachable(arm)]
        self.arms.append(Arm(PLAIN, with_memory_switches(plain_switches, pick_switches), False,
                             channels_last=False if self.layout is not None else None,
                             fused_ops=frozenset() if self.fused.modules else None))
        self.clock = StepClock(device)
        self.steps = 0                      # real steps seen
        self.round, self.slot, self.in_window = 0, 0, 0
        self.lead = 1                       # the current window's untimed steps: 1 after a switch, else 0
        self.window: List[float] = []       # the current window's timed seconds
        self.last_mark: Any = None
        self.result: Optional[GuardResult] = None
        self.running = list(self.arms)      # the arms still timed: one slower than plain and than another drops
        self.handle = optimizer.register_step_post_hook(self._after_step)
        self.forward_handle = model.register_forward_pre_hook(self._before_forward)
        self._use(self._order()[0])

    # -- the schedule ---------------------------------------------------------------------------------
    def _order(self) -> List[Arm]:
        """This round's arms: forwards in even rounds, backwards in odd ones (the module docstring)."""
        return list(self.running) if self.round % 2 == 0 else self.running[::-1]

    def _reachable(self, arm: Arm) -> bool:
        """The model can compute as ``arm`` exactly (see `Arm`)."""
        if arm.half_compute and self.compute is None:
            return False
        if arm.half_compute and arm.level not in (None, self.compute.level) \
                and not self.compute.level_switchable(self.model):
            return False
        if arm.fused_ops is not None and not arm.fused_ops <= self.fused.ops:
            return False
        return not arm.channels_last or self.layout is not None

    def _use(self, arm: Arm) -> None:
        write_switches(arm.switches)
        if self.compute is not None:
            self.compute.enabled = arm.half_compute
            level = arm.level or self.pick_level
            if arm.half_compute and level != self.compute.level:
                self.compute.switch_level(self.model, level)
        if self.layout is not None:
            on = self.pick_layout if arm.channels_last is None else arm.channels_last
            if on != self.layout.on:
                self.layout.switch(self.model, on, self.optimizer)
        self.fused.switch(self.fused.ops if arm.fused_ops is None else arm.fused_ops)

    def _before_forward(self, module, args) -> None:
        if self.last_mark is None and module.training and torch.is_grad_enabled():
            self.last_mark = self.clock.mark()   # a step's first training forward: its clock starts

    def _after_step(self, optimizer, args, kwargs) -> None:
        mark = self.clock.mark()
        if self.last_mark is not None and self.in_window >= self.lead:   # a step after a switch is not timed
            self.window.append(self.clock.seconds(self.last_mark, mark))
        self.last_mark = None
        self.steps += 1
        self.in_window += 1
        if self.in_window < self.lead + TIMED_STEPS:
            return
        order = self._order()
        ending = order[self.slot]
        ending.seconds.append(sum(self.window))
        self.window, self.in_window = [], 0
        self.slot += 1
        if self.slot == len(order):
            self.slot = 0
            self.round += 1
            self._drop_the_beaten()
            if self._done():
                self._decide()
                return
        following = self._order()[self.slot]
        self.lead = 0 if following is ending else 1
        self._use(following)

    # -- the decision ---------------------------------------------------------------------------------
    def _ratios(self, arm: Arm) -> List[float]:
        plain = self.arms[-1]
        return [p / s for p, s in zip(plain.seconds, arm.seconds) if s > 0]

    def _drop_the_beaten(self) -> None:
        """From `MIN_ROUNDS` on, stop timing an arm that was slower than plain beyond `NOISE_FLOOR` in every round
        and slower than another arm in every round: its windows only cost the run (the pick's steps under load)."""
        if self.round < MIN_ROUNDS:
            return
        for arm in [a for a in self.running[:-1]]:
            mine = self._ratios(arm)
            others = [self._ratios(a) for a in self.running[:-1] if a is not arm]
            if max(mine) < 1 / (1 + NOISE_FLOOR) and any(all(o > m for o, m in zip(other, mine)) for other in others):
                self.running.remove(arm)

    def _done(self) -> bool:
        """After `MAX_ROUNDS`, or from `MIN_ROUNDS` on where more rounds would not change the decision: every arm
        faster than plain beyond `NOISE_FLOOR` in every round or slower in every one, and the fastest of those
        faster ahead of each other one in every round (`aiak.measure.rounds.ranking_is_clear`); or the arm `choose`
        picks stays picked however the rounds left go, short of an arm beating its best round so far or the chosen
        one falling behind its worst (`_choice_stays`). The windows of an arm the run will not keep only cost the
        run."""
        if self.round >= MAX_ROUNDS:
            return True
        if self.round < MIN_ROUNDS:
            return False
        return self._choice_stays() or ranking_is_clear([self._ratios(a) for a in self.running[:-1]])

    def _choice_stays(self) -> bool:
        """`choose` picks an arm on the rounds so far, and would still pick it were every arm still timed to run each
        round left up to `MAX_ROUNDS` as far ahead of plain as in its best round so far, the chosen one as far
        behind as in its worst (plain at its mean); an arm other than plain compute only where it ran ahead of plain
        beyond `NOISE_FLOOR` in every round. So beside a near tie that cannot win (DemoNet's fp32 channels_last arm at
        1.01-1.13x plain, its pick at 1.8x), the rounds end."""
        def arms(left: int, chosen: Optional[str]) -> List[Tuple[str, List[float], Optional[int]]]:
            plain = self.arms[-1].seconds
            typical = statistics.mean(plain)
            return [(a.label, a.seconds + ([typical / (min if a.label == chosen else max)(self._ratios(a))] * left
                                           if a in self.running else []),
                     a.switches.get("num_threads")) for a in self.arms[:-1]] + [(PLAIN, plain + [typical] * left, None)]

        if not all(self._ratios(a) for a in self.running[:-1]):
            return False
        chosen = choose(arms(0, None), self.prefer)[0]
        if chosen != PLAIN and min(self._ratios(next(a for a in self.arms if a.label == chosen))) <= 1 + NOISE_FLOOR:
            return False   # an arm near plain: a tail of slow steps under load may yet show (the rounds go on)
        return all(choose(arms(left, chosen), self.prefer)[0] == chosen for left in (0, MAX_ROUNDS - self.round))

    def _decide(self) -> None:
        chosen, why, speedups, rounds = choose([(a.label, a.seconds, a.switches.get("num_threads")) for a in self.arms],
                                               self.prefer)
        self._use(next(a for a in self.arms if a.label == chosen))
        if self.attached is not None and not self.layout.on:   # the layout it attached is not needed
            self.attached.remove()
        self.handle.remove()
        self.forward_handle.remove()
        self.result = GuardResult(chosen, speedups, rounds, self.steps, self.load.to_dict(),
                                  {a.label: int(a.switches.get("num_threads", 0)) for a in self.arms}, why)
        if chosen != PICK and is_rank_zero():  # a notice beside optimize()'s own lines: the run goes on, as it should
            print(self.warning(), file=sys.stderr, flush=True)
        self.on_decision(self.result)

    def warning(self) -> str:
        """The one notice a change of compute gives on stderr (empty while the pick is kept)."""
        r = self.result
        if r is None or r.chosen == PICK:
            return ""
        figures = ", ".join(f"{label} {s:.2f}x" for label, s in r.speedups.items() if label != PLAIN)
        load = r.load
        busy = (f"{load['busy_elsewhere']} runnable task(s) of other work on {load['cores']} core(s)"
                if load.get("busy_elsewhere") is not None else f"load average {load['load1']}")
        now = (f"the pick on {r.threads[BUDGET]} intra-op thread(s)" if r.chosen == BUDGET
               else "plain PyTorch (fp32, the script's own threads)" if r.chosen == PLAIN
               else f"the trials' candidate {r.chosen!r}")
        return (f"aiak: in the run's first {r.steps} steps, in alternating windows, {figures} of plain compute's "
                f"speed ({busy}); the rest of the run computes as {now}. The tuning cache keeps this beside the "
                f"load; under another load the trials measure again")


def choose(arms: List[Tuple[str, List[float], Optional[int]]], prefer: Sequence[str] = (PICK,)
           ) -> Tuple[str, str, Dict[str, float], Dict[str, List[float]]]:
    """The guard's rule (see the module docstring), on each arm's `(label, seconds per round, threads)`, the pick
    first and plain compute last: the arm with the highest speedup, unless an arm of ``prefer`` (in its order;
    plain compute among them counts as 1.0x) is within noise of it; then plain compute where that arm took longer
    in sum than plain beyond `NOISE_FLOOR` (the promise comes first).

    Returns:
        `(chosen label, why, speedups, per-round ratios)`: each arm's speedup is plain's seconds over its own, summed
            over the rounds; the per-round ratios are those of every arm but plain.
    """
    plain = arms[-1][1]
    speedup = {label: round(sum(plain[:len(s)]) / sum(s), 3) for label, s, _ in arms if sum(s) > 0}  # its rounds
    if PICK not in speedup or not sum(plain):   # no step was timed (a loop whose steps run no training forward)
        return PICK, "nothing could be timed: the pick stays", speedup, {}
    rounds = {label: [round(p / t, 3) for p, t in zip(plain, s) if t > 0] for label, s, _ in arms[:-1]}
    threads = {label: n for label, _, n in arms}

    def noise(label: str) -> float:
        r = rounds.get(label)
        return max(NOISE_FLOOR, (max(r) - min(r)) / (2 * statistics.median(r))) if r else NOISE_FLOOR

    best = max((label for label, _, _ in arms[:-1] if label in speedup), key=speedup.get)
    chosen = next((label for label in prefer if label in speedup
                   and speedup[label] * (1 + max(noise(label), noise(best))) >= speedup[best]), best)
    why = {PICK: "the pick kept up with plain PyTorch", PLAIN: "no arm ran faster than plain PyTorch beyond noise",
           BUDGET: f"{threads.get(BUDGET)} intra-op thread(s) ran faster than the pick's {threads.get(PICK)} on this "
                   f"busy machine"}.get(chosen, f"{chosen!r} ran fastest")
    if speedup[chosen] < 1 / (1 + NOISE_FLOOR):  # the promise first: under doubt, the run computes as plain
        chosen, why = PLAIN, "the pick's steps took longer in sum than plain PyTorch's"
    return chosen, why, speedup, rounds


def not_watched(strategy: Any, optimizer: Any) -> str:
    """Why the guard cannot watch a run of ``strategy`` stepping ``optimizer`` (see the module docstring), or ""."""
    return ("tune.guard is false" if not strategy.tune.guard
            else "fp8 layers cannot be switched between steps" if strategy.precision.fp8 != "off"
            else "under torch.compile, switching the compute would recompile" if strategy.compile
            else "on several ranks, each would choose alone" if is_distributed()
            else "the optimizer takes no step hook" if not hasattr(optimizer, "register_step_post_hook") else "")


def watch(tuning: Any, strategy: Any, model: torch.nn.Module, optimizer: Any, plain_switches: Dict[str, Any],
          device: torch.device, decision: Any) -> Optional[SpeedGuard]:
    """Start the guard on a run `optimize()` just applied, where it can run (see the module docstring); its
    standing is written into `decision.guard` now and its figures once it decides.

    Args:
        tuning: the trials' `Tuning` (None when no trial was asked for).
        strategy: the strategy applied.
        model: the model the strategy computes with (inside any DDP).
        optimizer: the optimizer the step runs (unwrapped).
        plain_switches: the process switches as the script had them before `optimize()`.
        device: where the model computes.
        decision: the decision record of this `optimize()`.

    Returns:
        The guard, or None where it does not run (the reason is in `decision.guard`).
    """
    if tuning is None or tuning.skipped or tuning.label == "plain":
        return None
    off = not_watched(strategy, optimizer)
    if off:
        decision.guard = {"chosen": PICK, "why": f"not run: {off}"}
        return None

    def decided(result: GuardResult) -> None:
        decision.guard = result.to_dict()
        tuning.learn(result.to_dict())

    compute = next((h.__self__ for m in model.modules() for h in m._forward_pre_hooks.values()
                    if isinstance(getattr(h, "__self__", None), HalfCompute)), None)
    watching = SpeedGuard(optimizer, model, compute, read_switches(), plain_switches, cpu_load(), device, decided,
                          others=tuning.arms, prefer=tuning.prefer or [PICK])
    others = ", ".join(repr(arm.label) for arm in watching.arms if any(arm is a for a in tuning.arms))
    decision.guard = {"chosen": PICK, "why": f"watching the run's first steps against plain compute"
                                             f"{f' and the candidates {others}' if others else ''}"}
    return watching
