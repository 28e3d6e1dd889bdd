"""The phases of applying a strategy, one row each, in the order `aiak.apply.apply_strategy` runs them: the
knobs each applies, what it does, and what the rollback puts back if a later phase fails.

The order is the one of applying a strategy (process switches, module surgery on the bare model, the optimizer
and precision, DDP and its hook, ``torch.compile`` last, the loader). Every knob of `aiak.strategy.knobs.KNOBS`
is applied by exactly one phase, except those that choose the strategy (``acts_on`` selection), which no phase
reads; ``tests/strategy/test_phases.py`` fails otherwise.

This table sits beside the knob table, not in it, because the two are different ideas: a knob row says what one
setting is (the auto-selector and the numerics gate read it); a phase row says what one step of applying does,
in which order, and how it is undone (``apply.py`` runs it; ARCHITECTURE.md shows it). It lives in ``strategy/``
rather than in ``apply.py`` because it partitions the knob table, checkable without applying anything, and
because ``apply.py`` imports ``strategy/``, never the reverse: here each phase is a name, and ``apply.py`` maps
each name to its function (``aiak.apply.PHASES``, the same names in the same order).

The phases a later ``optimize()`` of another optimizer of an optimized model runs are read from the knob table's
``acts_on`` (`per_optimizer`), never listed by hand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from aiak.strategy.knobs import KNOBS, MODEL_LEVEL, PROCESS, Knob


@dataclass(frozen=True)
class Phase:
    name: str
    reads: Tuple[str, ...]    # the knobs it applies: paths of KNOBS (a section's name: every knob under it)
    applies: str              # what it does, in one line
    rollback: str             # what runtime/rollback.py's Snapshot puts back for it if a later phase fails
    looks_at: Tuple[str, ...] = ()   # knobs another phase applies that this one consults


PHASES: Tuple[Phase, ...] = (
    Phase("switches", tuple(k.path for k in KNOBS if k.acts_on == PROCESS),
          "the process-wide switches (`runtime/switches.py`, `runtime/affinity.py`, `runtime/malloc.py`), each by its "
          "knob row's function",
          "every process switch, as `read_switches` read it before"),
    Phase("surgery", ("fused_ops",),
          "fused modules in place of the bare model's (`ops/surgery.py`, the registry of fused ops: Swin window "
          "attention; `ops/lm_head.py`: a causal or masked LM's loss without its logits, "
          "`ops/linear_cross_entropy.py`; `ops/pointwise_conv.py`: 1x1 convolutions as matrix multiplies), before any "
          "wrapping",
          "each submodule's class and attribute dicts: the replaced modules back in their parents"),
    Phase("optimizer", ("optimizer",),
          "LAMB or LARS in place of the given optimizer (`optim/factory.py`), or the given one kept, stepping torch's "
          "fused kernel with `optimizer.fused` (`optim/fused_step.py`)",
          "the given optimizer's attributes (its hooks among them) and param groups (a swapped-in optimizer is "
          "dropped)"),
    Phase("channels_last", ("channels_last",),
          "NHWC weights and 4-D inputs on the bare model, the optimizer's state laid out like its parameters, also "
          "when a checkpoint is loaded into it (`runtime/switches.py`)",
          "each parameter's, buffer's and optimizer state's tensor (its layout), the modules' and the optimizer's "
          "hook dicts"),
    Phase("precision", ("precision",),
          "O1/O2 half compute hooked on the bare model (`amp/precision.py`, `amp/half_compute.py`, traced under "
          "compile by `amp/compiled_region.py`); its fp16 parameters handed to root scaling once every phase "
          "applied; fp16 loss scaling (`amp/scaling/loss_scaler.py`, `amp/scaling/root_scaling.py`); fp8 linear layers (`amp/fp8.py`), warned about "
          "where they would be slow (emulated, or without compile)",
          "the modules' classes, hook dicts and attributes (the parameters are never changed); the once-per-process "
          "wrappers of torch's backward and GradScaler stay",
          looks_at=("compile", "comm.engine", "comm.fsdp")),
    Phase("step_controller", ("grad_accumulation",),
          "the step controller on the optimizer (`step/controller.py`); the scheduler re-pointed to a swapped one",
          "the optimizer's and the scheduler's attributes (its own `step`, `zero_grad` and state_dict hooks); "
          "the once-per-process GradScaler wrapper stays",
          looks_at=("comm.algorithm", "comm.compression", "comm.autotune", "comm.tune_int8")),
    Phase("ddp", ("comm",),
          "DistributedDataParallel and aiak's communication hook (`comm/ddp.py`, `comm/allreduce/hooks.py`), or the "
          "hook on the script's DDP; under `comm.engine: fsdp2` the model sharded by FSDP2 and the optimizer "
          "re-pointed to its shards (`comm/fsdp.py`); a model the script sharded left unwrapped, FSDP2's switches "
          "handed to the step controller (`comm/sharded.py`)",
          "the given model's attributes (a DDP aiak built is dropped); a model aiak sharded: each module's class, "
          "parameters and hooks; collectives already issued stay done",
          looks_at=("precision.level", "precision.dtype", "grad_accumulation")),
    Phase("compile", ("compile",),
          "`torch.compile` in place, last of the model's phases (`runtime/compile.py`)",
          "the model's attributes (its compiled call)"),
    Phase("loader", ("loader",),
          "prefetch, pinning, balanced batches (`loaders/__init__.py`); with accumulation or counted items, "
          "`loaders/window_loader.py` telling the step controller each batch it hands out, the epoch's length and what "
          "each batch holds",
          "the loader's, its sampler's and batch sampler's attributes (a wrapper aiak built is dropped)",
          looks_at=("channels_last",)),
)


def reads(read: str, knob: Knob) -> bool:
    """Whether a phase reading ``read`` (a knob's path, or a section's name) reads ``knob``."""
    return knob.path == read or knob.path.startswith(read + ".")


def knobs_of(phase: Phase) -> Tuple[Knob, ...]:
    """The rows of `KNOBS` that ``phase`` applies."""
    return tuple(k for k in KNOBS if any(reads(r, k) for r in phase.reads))


def per_optimizer() -> Tuple[str, ...]:
    """The phases that act on one optimizer or its loader, in order: what ``optimize()`` runs for another optimizer
    of a model optimized before (the other phases' knobs are the model's, kept as first applied)."""
    return tuple(p.name for p in PHASES if not any(k.acts_on in MODEL_LEVEL for k in knobs_of(p)))
