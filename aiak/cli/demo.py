"""The built-in demo: a small CNN with BatchNorm trained on synthetic images, baseline vs optimized.

Used by ``aiak demo`` (train both, alternating them in rounds, and compare), and as the ``demo`` model SPEC
of ``aiak bench`` and ``aiak explain``. CPU-sized by default: the whole demo runs in about a minute.
"""
from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aiak.cli.progress import Board
from aiak.measure import rounds as measure
from aiak.measure.rounds import Contender, Speedup, alternate, plan_rounds, speedup
from aiak.runtime.switches import read_switches
from aiak.step.training_step import training_step


class DemoNet(nn.Module):
    """Conv-BN-ReLU x3 with stride, global pooling and a linear head (ResNet-like stem, tiny)."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()

        def block(cin, cout, stride):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.features = nn.Sequential(block(3, width, 1), block(width, 2 * width, 2), block(2 * width, 4 * width, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def synthetic_dataset(n: int = 2048, image_size: int = 32, num_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Learnable synthetic images: each class is a fixed random pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 3, image_size, image_size, generator=g)
    return TensorDataset(images, labels)


def make_setup(seed: int = 0, n: int = 2048, batch_size: int = 64, lr: float = 0.05, width: int = 32):
    torch.manual_seed(seed)
    model = DemoNet(width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    loader = DataLoader(synthetic_dataset(n, seed=seed), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed), drop_last=True)
    return model, optimizer, loader


def training_steps(model, optimizer, loader, epochs: Optional[int], device: Any = "cpu") -> Iterator[torch.Tensor]:
    """A plain training loop, exactly what a user writes (aiak never asks for a different one), one step
    per ``next()``: each yields that step's loss. ``epochs=None`` goes on for as long as it is asked."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs) if epochs is not None else itertools.count():
        for x, y in loader:
            batch = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            yield training_step(model, optimizer, batch, lambda m, b: criterion(m(b[0]), b[1]))


class DemoError(ValueError):
    """Demo arguments that leave no room for an honest measurement; the message names them."""


@dataclass
class DemoResult:
    """Both runs of `run_demo`: the same steps, the same data, alternated in rounds."""

    baseline: Contender
    optimized: Contender
    speedup: Optional[Speedup]  # of the training steps, per round; None when a side stopped before a round
    setup_seconds: float        # aiak.optimize() (the trials of "auto" included), paid once before the steps
    batch_size: int
    warmup: int                 # steps per side before the timing (they train too)
    extra_rounds: int = 0       # rounds added because the planned ones were too noisy to tell

    @property
    def end_to_end(self) -> Optional[float]:
        """Baseline seconds / aiak's seconds over every step, aiak's optimize() included: what a run of this
        length gains once the tuning is paid for (one sum per side, so no interval of its own). None when a
        side stopped."""
        if self.baseline.stopped or self.optimized.stopped:
            return None
        base = sum(self.baseline.warmup_seconds) + sum(self.baseline.step_seconds)
        mine = sum(self.optimized.warmup_seconds) + sum(self.optimized.step_seconds) + self.setup_seconds
        return base / mine


def plan(epochs: int, n: int, batch_size: int, rounds: int, warmup: int) -> Tuple[int, int, int]:
    """``(steps per side, steps per round, warm-up steps)`` of a demo (`aiak.measure.rounds.plan_rounds`);
    `DemoError` naming the flags when the steps do not fill ``warmup`` steps and ``rounds`` rounds."""
    steps = epochs * (n // batch_size)
    try:
        warmup, per_round = plan_rounds(steps, rounds, warmup)
    except ValueError:
        raise DemoError(f"--epochs {epochs} x (--samples {n} // --batch-size {batch_size}) = {steps} steps, fewer "
                        f"than --warmup {warmup} + --rounds {rounds}: give more samples or epochs, or fewer "
                        "rounds") from None
    return steps, per_round, warmup


def run_demo(strategy: Any = "auto", epochs: int = 2, n: int = 6400, batch_size: int = 64, *, rounds: int = 20,
             warmup: int = 5, show_progress: bool = True, seed: int = 0) -> DemoResult:
    """Train the demo model twice from the same weights on the same batches, plain PyTorch and
    ``aiak.optimize(strategy=...)``, alternating the two in ``rounds`` rounds after ``warmup`` steps each
    (`aiak.measure.rounds.alternate`). Steps that do not fill a round are added to the warm-up, so both
    sides train every step of ``epochs`` epochs."""
    import aiak

    steps, per_round, warmup = plan(epochs, n, batch_size, rounds, warmup)

    model, optimizer, loader = make_setup(seed, n, batch_size)
    init = copy.deepcopy(model.state_dict())
    baseline = Contender("baseline", training_steps(model, optimizer, loader, None).__next__,
                         switches=read_switches())

    model, optimizer, loader = make_setup(seed, n, batch_size)
    model.load_state_dict(init)
    start = time.perf_counter()
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
    setup = time.perf_counter() - start
    optimized = Contender("aiak", training_steps(model, optimizer, loader, None).__next__, switches=read_switches())

    sides = [baseline, optimized]
    with Board({"baseline": steps, "aiak": steps}, enabled=show_progress) as board:
        def progress(c, done, total):
            board.update(c.name, done, c.loss if c.loss == c.loss else None)

        # a step that raises stops its side with the error as its reason (shown, not a traceback); the 10x rule
        # is read at call time so that a test can tighten it
        alternate(sides, warmup=warmup, rounds=rounds, steps_per_round=per_round, progress=progress, catch=True,
                  slow_factor=measure.SLOW_FACTOR)
        ratio = _speedup_or_none(sides)
        extra = 0
        if ratio is not None and ratio.too_noisy:  # the machine's load decided: as many rounds again, once
            extra = rounds
            board.note(f"  the first {rounds} rounds were too noisy to tell a speedup (their ratios span "
                       f"{ratio.low:.2f}-{ratio.high:.2f}x): {extra} more rounds, {extra * per_round} more steps each")
            for c in sides:
                board.grow(c.name, c.steps + extra * per_round)
            alternate(sides, warmup=0, rounds=extra, steps_per_round=per_round, progress=progress, catch=True,
                      slow_factor=math.inf)
            ratio = _speedup_or_none(sides)
    return DemoResult(baseline, optimized, ratio, setup, batch_size, warmup, extra)


def decision_lines(decision: Any) -> List[str]:
    """What the demo says of where aiak's strategy came from: a decision reused from the tuning cache (and how to
    measure again), one measured again because the machine's load differed, and the run-time guard's figures."""
    from aiak.tune.decision import guard_line
    from aiak.util.cache import default_cache_path

    lines = []
    if decision is None:
        return lines
    if decision.cache_hit:
        lines.append(f"  aiak's strategy was decided by an earlier run's trials, reused from the tuning cache "
                     f"({default_cache_path()}) under the same load; to measure again, delete that file or set "
                     f"AIAK_TUNE_CACHE to another one")
    elif "measured again" in decision.tuning:
        lines.append(f"  the tuning cache held a decision for this model: {decision.tuning}")
    if decision.guard:
        lines.append(f"  run-time guard: {guard_line(decision.guard)}")
    return lines


def _speedup_or_none(sides) -> Optional[Speedup]:
    baseline, optimized = sides
    if baseline.stopped or optimized.stopped or not optimized.round_seconds:
        return None
    return speedup(baseline.round_seconds, optimized.round_seconds)
