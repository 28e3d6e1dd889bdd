"""Every knob of a strategy, one row each: what it acts on and how the auto-selector treats it.

The lists other modules need are read from this table, never kept by hand beside it:

* `model_knobs`: knobs applied once per model, kept by a later ``optimize()`` of another optimizer of
  the same model (`aiak.apply`);
* `neutral_keys`: knobs that cannot change what is computed beyond the float rounding of another kernel or
  layout, so a candidate changing only these skips the numerics gate (`aiak.tune.gate`);
* `training_keys`: knobs that change *what* is trained (the effective batch, the update rule, the data),
  which every candidate takes from the rules' pick (`aiak.tune.candidates`);
* `untimed_keys`: knobs a trial step does not exercise (the loader, DDP, the process's CPU set, the
  tuning settings), also the pick's in every candidate;
* `process_knobs`: the process-wide knobs, which `aiak.apply` applies from their rows (``apply``), and
  the settings of `aiak.runtime.switches.process_switches` each writes (``switches``), which the rollback
  and the trials put back.

Which phase of applying a strategy applies each knob is the phase table's (`aiak.strategy.phases`).
A new knob is a field of its section (with its type), its apply function, a row here, its phase's entry and its
test; ``tests/strategy/test_knobs.py`` fails while a field of the schema has no row, or a process knob writes a
setting its row does not name, and ``tests/strategy/test_phases.py`` while a row is in no phase.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from aiak.comm.algorithms import REGISTRY
from aiak.runtime.affinity import apply_cpu_affinity
from aiak.runtime.malloc import apply_malloc_retain
from aiak.runtime.switches import apply_cudnn_benchmark, apply_tf32

PROCESS = "process"        # process-wide switches (runtime/switches.py, runtime/affinity.py, runtime/malloc.py)
MODEL = "model"            # the model's modules, hooks, layout or precision (ops/, amp/, runtime/)
DDP = "ddp"                # the DistributedDataParallel wrapping and its communication hook (comm/)
OPTIMIZER = "optimizer"    # one optimizer's update and stepping (optim/, step/)
LOADER = "loader"          # the loader's wrapping (loaders/)
SELECTION = "selection"    # how the strategy itself is chosen (tune/)
MODEL_LEVEL = (PROCESS, MODEL, DDP)   # applied once per model; the rest per optimizer (or by selection)


@dataclass(frozen=True)
class Knob:
    path: str                # dotted key path; a section's name covers every key under it ("optimizer")
    acts_on: str             # PROCESS, MODEL, DDP, OPTIMIZER, LOADER or SELECTION
    changes_training: bool   # changes what is trained, not only how fast
    neutral: bool            # numerics-neutral: another layout or schedule of the same arithmetic
    timed: bool              # exercised by a trial step (the trials run the step without DDP and feed batches)
    # process knobs only: apply(value, device) -> what was done; the process settings it may write
    apply: Optional[Callable[[Any, Any], str]] = None
    switches: Tuple[str, ...] = ()


KNOBS: Tuple[Knob, ...] = (
    #     path                    acts on    training neutral timed
    Knob("tf32",                  PROCESS,   False,   False,  True,
         apply_tf32, ("matmul.allow_tf32", "cudnn.allow_tf32")),
    Knob("cudnn_benchmark",       PROCESS,   False,   True,   True,
         apply_cudnn_benchmark, ("cudnn.benchmark",)),
    Knob("cpu_affinity",          PROCESS,   False,   True,   False,
         apply_cpu_affinity, ("cpu_affinity", "num_threads")),
    Knob("malloc_retain",         PROCESS,   False,   True,   False,
         apply_malloc_retain, ("malloc_retain",)),
    Knob("channels_last",         MODEL,     False,   True,   True),
    Knob("compile",               MODEL,     False,   False,  True),
    Knob("precision.level",       MODEL,     False,   False,  True),
    Knob("precision.dtype",       MODEL,     False,   False,  True),
    Knob("precision.loss_scale",  MODEL,     False,   False,  True),
    Knob("precision.keep_fp32",   MODEL,     False,   False,  True),
    Knob("precision.fp8",         MODEL,     False,   False,  True),
    Knob("precision.fp8_skip",    MODEL,     False,   False,  True),
    Knob("fused_ops",             MODEL,     False,   False,  True),
    Knob("grad_accumulation",     OPTIMIZER, True,    False,  True),
    Knob("optimizer.fused",       OPTIMIZER, False,   True,   True),
    Knob("optimizer",             OPTIMIZER, True,    False,  True),
    Knob("loader.prefetch",       LOADER,    False,   True,   False),
    Knob("loader.pin_memory",     LOADER,    False,   True,   False),
    Knob("loader.balanced",       LOADER,    True,    False,  False),
    Knob("loader.max_tokens",     LOADER,    True,    False,  False),
    Knob("loader.mean",           LOADER,    True,    False,  False),
    Knob("loader.std",            LOADER,    True,    False,  False),
    Knob("comm.hierarchical",     DDP,       False,   True,   False),
    Knob("comm.compression",      DDP,       False,   False,  False),
    Knob("comm.bucket_mb",        DDP,       False,   True,   False),
    Knob("comm.autotune",         DDP,       False,   True,   False),
    Knob("comm.perf_mode",        DDP,       False,   True,   False),
    Knob("comm.tune_steps",       DDP,       False,   True,   False),
    Knob("comm.tune_cache",       DDP,       False,   True,   False),
    Knob("comm.tune_int8",        DDP,       False,   False,  False),
    Knob("comm.deadlock_guard",   DDP,       False,   True,   False),
    Knob("comm.timeout_s",        DDP,       False,   True,   False),
    Knob("comm.compress_intra",   DDP,       False,   False,  False),
    Knob("comm.int8_block",       DDP,       False,   False,  False),
    Knob("comm.pipeline_mb",      DDP,       False,   True,   False),
    Knob("comm.stall_warn_s",     DDP,       False,   True,   False),
    Knob("comm.connections",      DDP,       False,   True,   False),
    Knob("comm.cpu_reduce",       DDP,       False,   True,   False),
    Knob("comm.find_unused_parameters", DDP, False,   True,   False),
    Knob("comm.algorithm",        DDP,       True,    False,  False),
    Knob("comm.engine",           DDP,       False,   False,  False),
    Knob("comm.fsdp",             DDP,       False,   False,  False),
    *(Knob(f"comm.{name}",        DDP,       True,    False,  False)   # each algorithm's settings section
      for name, algorithm in REGISTRY.items() if algorithm.settings is not None),
    Knob("tune.enabled",          SELECTION, False,   True,   False),
    Knob("tune.candidates",       SELECTION, False,   True,   False),
    Knob("tune.steps",            SELECTION, False,   True,   False),
    Knob("tune.max_seconds",      SELECTION, False,   True,   False),
    Knob("tune.guard",            SELECTION, False,   True,   False),
)


def knob(path: str) -> Knob:
    """The row of ``path`` (a key inside a section row's section, such as ``optimizer.lr``, gets that row)."""
    for row in KNOBS:
        if path == row.path or path.startswith(row.path + "."):
            return row
    raise KeyError(f"no knob {path!r} in aiak.strategy.knobs.KNOBS")


def model_knobs() -> Tuple[str, ...]:
    """Top-level keys applied once per model (to the process, the model or its DDP), in table order."""
    return tuple(dict.fromkeys(k.path.partition(".")[0] for k in KNOBS if k.acts_on in MODEL_LEVEL))


def neutral_keys() -> Tuple[str, ...]:
    return tuple(k.path for k in KNOBS if k.neutral)


def training_keys() -> Tuple[str, ...]:
    return tuple(k.path for k in KNOBS if k.changes_training)


def untimed_keys() -> Tuple[str, ...]:
    return tuple(k.path for k in KNOBS if not k.timed and not k.changes_training)


def process_knobs() -> Tuple[Knob, ...]:
    """The process-wide knobs, in the order `aiak.apply` applies them."""
    return tuple(k for k in KNOBS if k.acts_on == PROCESS)
