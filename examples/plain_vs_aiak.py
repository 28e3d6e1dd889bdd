"""The examples' before/after line: plain PyTorch and aiak trained side by side, alternating in rounds.

Not something a training script needs: each example's ``--no-compare`` trains with aiak alone. With the
comparison on, the example builds its setup twice from one seed (same weights, same batches), passes one copy
through ``aiak.optimize`` and leaves the other plain, then hands both training loops (generators yielding each
step's loss) to :func:`compare`. That is how ``aiak demo`` measures (:func:`aiak.cli.demo.run_demo`): on a shared
machine a step's time drifts several-fold within minutes, so one run of each side after the other measures the
drift as much as aiak. Here both sides warm up in turn, the timed steps are cut into rounds with the order
rotating, and the speedup is the median of the per-round ratios with its confidence interval
(:mod:`aiak.measure.rounds`), called "within noise" when the interval straddles 1.00x or the median is within 3% of it.

Global switches that ``aiak.optimize`` sets for the process (TF32, cuDNN autotuning) would also speed up the
plain side; each side's steps run under its own setting of them, so the plain side stays plain.
"""
from __future__ import annotations

import math
import sys
from typing import Iterator, Sequence, Tuple

import torch

from aiak.measure.rounds import Contender, alternate, plan_rounds, speedup
from aiak.runtime.rollback import write_switches
from aiak.util.status_line import StatusLine


class Side:
    """One training run: its loop (a generator of step losses), its model (for the held-out loss), and the
    switches its steps run under (:func:`aiak.runtime.rollback.read_switches`, taken right after it was set up)."""

    def __init__(self, name: str, steps: Iterator[torch.Tensor], model: torch.nn.Module, switches: dict):
        self.name, self.steps, self.model, self.switches = name, steps, model, switches

    def step(self) -> torch.Tensor:
        return next(self.steps)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                  device: torch.device) -> float:
    """Mean cross-entropy of ``model`` (in eval mode) over ``(inputs, labels)`` batches neither side trained on:
    the same data for both sides, where the last training batches may differ (balanced batches reorder them)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for inputs, labels in batches:
        logits = model(inputs.to(device))
        total += float(torch.nn.functional.cross_entropy(logits.float(), labels.to(device), reduction="sum"))
        count += len(labels)
    model.train(was_training)
    return total / count


def check_steps(total_steps: int, rounds: int, multiple_of: int = 1, warmup: int = 2) -> None:
    """Exit with one line naming the flags when the run is too short to compare (before anything trains)."""
    try:
        plan_rounds(total_steps, rounds, warmup, multiple_of)
    except ValueError as e:
        raise SystemExit(f"{sys.argv[0]}: --compare: {e} step(s): raise --samples or --epochs, or lower "
                         "--rounds") from None


def compare(plain: Side, aiak: Side, *, total_steps: int, samples_per_step: int, device: torch.device,
            held_out: Sequence[Tuple[torch.Tensor, torch.Tensor]], rounds: int = 8, warmup: int = 2,
            multiple_of: int = 1) -> str:
    """Run ``total_steps`` steps of both sides, alternating, and return the before/after line (one line, wrapped
    here)::

        before/after: plain 812.3 samples/s, aiak 1377.0 samples/s: 1.70x faster (99.2% CI 1.61-1.78x, 8 rounds);
        held-out loss plain 0.4123, aiak 0.4051

    The throughput is ``samples_per_step`` (every rank's samples of one step) times the timed steps over their
    total time (not over the median step: with balanced batches of varying length the steps differ by design);
    the speedup is the median of the per-round ratios with its interval (:func:`aiak.measure.rounds.speedup`). The loss
    is each trained model's on the ``held_out`` batches. A side that :func:`aiak.measure.rounds.alternate` stops as too
    slow (10x the plain step) is reported as such. The aiak side always trains to the end of its loop (untimed
    past ``total_steps``, e.g. a balanced loader with more batches), so its model is trained fully either way.
    """
    warmup, per_round = plan_rounds(total_steps, rounds, warmup, multiple_of)
    contenders = [Contender(side.name, side.step, device, side.switches) for side in (plain, aiak)]
    with StatusLine("plain PyTorch and aiak, alternating") as status:   # on a terminal only
        alternate(contenders, warmup=warmup, rounds=rounds, steps_per_round=per_round,
                  progress=lambda c, done, total: status.update(f"{c.name} step {done} of {total}"))
    write_switches(aiak.switches)
    for _ in aiak.steps:
        pass
    stopped = [c for c in contenders if c.stopped]
    if stopped:
        return f"before/after: {stopped[0].name} {stopped[0].stopped}; no comparison"
    ratio = speedup(contenders[0].round_seconds, contenders[1].round_seconds)
    rate = [samples_per_step * len(c.step_seconds) / sum(c.step_seconds) for c in contenders]
    losses = []
    for side in (plain, aiak):  # aiak's last: the process keeps aiak's switches
        write_switches(side.switches)
        losses.append(held_out_loss(side.model, held_out, device))
    return (f"before/after: plain {rate[0]:.1f} samples/s, aiak {rate[1]:.1f} samples/s: {ratio.describe()}; "
            f"held-out loss plain {_loss(losses[0])}, aiak {_loss(losses[1])}")


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)
