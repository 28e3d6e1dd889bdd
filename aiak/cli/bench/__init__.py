"""``aiak bench``: a model's training step timed under plain PyTorch and under each strategy, in rounds.

    aiak bench [--model SPEC] [--strategy S ...] [--batch-size N] [--input-shape C,H,W] [--steps N]
               [--warmup N] [--rounds N] [--device D] [--json] [--trace DIR] [--plot FILE.png]

Every contender is built from the same SPEC (`aiak.cli.model_spec.build`) with the same seed, so all start
from the same weights and read the same batches in the same order: ``baseline`` is that setup untouched (plain
PyTorch, wrapped in DDP by hand under torchrun, as aiak wraps it), each strategy is ``aiak.optimize(model,
optimizer, loader, strategy=S)`` on a fresh build (``setup_s`` times that call, the trials of ``auto``
included; with the tuning cache warm, ``auto`` reuses its last decision and its trials do not run). A step is
what a user's loop does: next batch (the loader is re-iterated at its end), to the device,
`aiak.cli.model_spec.compute_loss`, ``backward()``, ``optimizer.step()``, ``zero_grad()``. Each contender
draws its random numbers (dropout) from its own stream, seeded alike, although the steps interleave: plain
PyTorch under another name (``--strategy default``) ends at the baseline's loss exactly.

Timing is `aiak.measure.rounds.alternate`: everybody warms up, the timed steps are cut into rounds in rotating
order, the speedup is the median of the per-round ratios with its confidence interval, "within noise" when
that interval holds 1.00x or the median is within 3% of it; a strategy over 10x slower than the baseline on its
first timed steps is stopped.
A strategy that raises in ``optimize()`` or in a step is reported as failed (exit code 1); the others go on.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``, reset whenever a contender's run of steps starts; on
a CPU the process RSS (``/proc/self/statm``) sampled after each forward, backward and optimizer step of the
contender. Both are the whole process's: every contender's weights live in it at once.

Under torchrun (``WORLD_SIZE`` > 1) bench joins the process group itself (gloo on CPU, NCCL on CUDA, env://,
with a timeout), every rank runs every contender on the same synthetic batches and only rank 0 prints. A
contender that fails on one rank is dropped on all (a failure that leaves the other ranks inside a collective
ends there at the process-group timeout, `DIST_TIMEOUT_S`). Linearity is per contender: the
multi-worker throughput / the single-worker throughput / workers, which is the single-worker median step over
the multi-worker one. The single worker is measured on rank 0 alone after the timing (and any trace): the same
model unwrapped from DDP (recompiled if the strategy compiled it), its optimizer and loader, the same warm-up
and rounds, the contenders alternating again, while the other ranks wait in a barrier whose timeout is ten
times rank 0's expected time plus two minutes. The idle ranks leave rank 0 the machine, as on a job of one
worker; rank 0 keeps the thread count torchrun gave it.

With ``--json`` stdout carries one JSON object and nothing else (``aiak bench --json | jq`` works); the table
goes to stderr then. ``--plot`` draws every step, warm-up included (shaded), per contender.
"""
from __future__ import annotations

from aiak.cli.bench.options import add_arguments

__all__ = ["add_arguments", "run"]


def run(args) -> int:
    """Run ``aiak bench`` with parsed ``args``; the command (and torch) load here, not at ``aiak --help``."""
    from aiak.cli.bench.command import run as run_bench

    return run_bench(args)
