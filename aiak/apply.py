"""The one applier of a strategy: the phases of the phase table (`aiak.strategy.phases`: switches, module
surgery, optimizer, channels_last, precision, the step controller, DDP, compile, loader), in that order, each a
function of `PHASES` that writes what it did into a `Summary`. The phases share one
`Applying` and apply the strategy with its derived settings resolved first (`aiak.strategy.derived`),
so no phase derives a setting itself.

``aiak.optimize()`` calls `apply_strategy` inside a `Snapshot` (all or nothing), and
the trials (`aiak.tune.trials`) call it on their copies with ``distributed=False``, so a candidate is timed
exactly as it would be applied.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from aiak import amp, comm, loaders, ops, optim
from aiak.comm.algorithms import algorithm_class
from aiak.comm import fsdp
from aiak.comm.sharded import ENGINE_NAMES, FSDP2, FSDPSync, sharding_of
from aiak.runtime.compile import apply_compile
from aiak.runtime.switches import apply_channels_last
from aiak.step.controller import StepController
from aiak.step.framework_ddp import framework_ddp
from aiak.strategy import knobs, phases
from aiak.strategy.derived import Derived, resolve_derived
from aiak.strategy.schema import Strategy
from aiak.util import warn
from aiak.util.machine.devices import model_device
from aiak.util.dist import world_size
from aiak.util.text import yaml_text


@dataclass
class Summary:
    """What each step of `apply_strategy` did, knob by knob: the "applied" part of the decision record."""

    lines: List[Tuple[str, str, str]] = field(default_factory=list)  # (knob, value, effect)

    def add(self, knob: str, value: object, effect: str) -> None:
        self.lines.append((knob, yaml_text(value), effect))


def skipped_reason(effect: str) -> Optional[str]:
    """Why a step skipped its knob, or None if it applied it: an effect that begins with "skipped" says so, as
    ``skipped: why`` or ``skipped (why)`` (the appliers' one convention, read by the decision record's headline)."""
    if not effect.startswith("skipped"):
        return None
    why = effect[len("skipped"):].strip()
    if why.startswith("(") and why.endswith(")"):
        why = why[1:-1]
    return why.lstrip(": ") or "skipped"


def compact(section: object, always: Tuple[str, ...]) -> Dict[str, object]:
    """A config section as a dict of the ``always`` keys plus every key that differs from its default."""
    defaults = type(section)()
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if f.name in always or getattr(section, f.name) != getattr(defaults, f.name)}


# The knobs that change the model itself (its modules, hooks, layout, wrapping) or the process, as opposed to one
# optimizer's stepping (optimizer, grad_accumulation) and the loader: a model optimized once keeps them.
MODEL_KNOBS = knobs.model_knobs()


@dataclass
class ModelRecord:
    """What ``optimize()`` applied to a model, kept on it (``model._aiak_applied``) for a later ``optimize()`` of
    another optimizer of the same model: two optimizers of one module, or Lightning calling
    ``configure_optimizers`` again for a second ``fit``. Model-level knobs (`MODEL_KNOBS`) are applied once;
    each optimizer gets its own step controller, sharing the model's loss scaler."""

    strategy: Strategy
    scaler: Any                   # the model's LossScaler (fp16), or None
    decision: Any                 # the decision record of that call


@dataclass
class Applied:
    """What `apply_strategy` returns: the (possibly wrapped) objects, the summary, the step controller, and
    the settings derived for this run (`aiak.strategy.derived`), for the decision record."""

    model: Any
    optimizer: Any
    loader: Any
    summary: Summary
    controller: Optional[StepController]
    scaler: Any = None
    derived: List[Derived] = field(default_factory=list)


@dataclass
class Applying:
    """What the phases of one `apply_strategy` call share, each leaving it for the next: the objects as the
    phases so far left them, what they built (the loss scaler, the step controller) and the facts of the call."""

    strategy: Strategy                 # with its derived settings: what the phases apply
    chosen: Strategy                   # as chosen, before them: what the summary's comm line quotes
    derived: List[Derived]             # the settings the strategy's resolution derived, with their reasons
    model: Any                         # what the caller gets back: the model given, or the DDP around it
    bare: Any                          # the model inside any DDP: surgery, layout and precision act on it
    user_optimizer: Any                # the optimizer given
    optimizer: Any                     # the optimizer the step runs: the given one, or one swapped in
    loader: Any
    scheduler: Any
    device: torch.device               # where the model computes
    count_items: Any                   # True, a function of a batch, or None (see apply_strategy)
    distributed: bool                  # DDP wrapping wanted (the trials: no)
    ranks: int                         # the ranks that train together: 1 unless distributed
    existing_ddp: Any                  # a DDP the script (or a framework) built before optimize(), or None
    sharding: Optional[str]            # the script sharded the model: aiak.comm.sharded.sharding_of
    record: Optional[ModelRecord]      # the model's first optimize(), when this is another optimizer's
    summary: Summary = field(default_factory=Summary)
    scaler: Any = None                 # fp16's loss scaler: the precision phase's, or the model's record's
    compute: Any = None                # the precision phase's HalfCompute (O1/O2), or None
    controller: Optional[StepController] = None

    def applied(self) -> Applied:
        return Applied(self.model, self.optimizer, self.loader, self.summary, self.controller, self.scaler,
                       self.derived)


def apply_strategy(s: Strategy, model: nn.Module, optimizer, loader, scheduler, device,
                   *, distributed: bool = True, model_applied: Optional[ModelRecord] = None,
                   count_items: Any = None) -> Applied:
    """Steps 2-7 of applying a validated strategy: each phase of `PHASES`, in order (the phase table,
    `aiak.strategy.phases`, says what each applies and reads), on the strategy with its derived settings
    (`aiak.strategy.derived`).

    The one place a strategy is applied: ``optimize()`` calls it (inside a `Snapshot`),
    and so do the trials (`aiak.tune.trials`, on copies, with ``distributed=False``: no DDP wrapping, one
    process, nothing derived). ``model_applied``: the model was optimized before (see `ModelRecord`); only
    the phases of one optimizer run. ``count_items``: ``True`` (the script calls ``aiak.count_items``) or a
    function of a batch the loader calls (`_wrap_loader`); either way the optimizer gets a step controller.
    """
    if model_applied is None and model is not None and device is not None:
        model.to(model_device(model, device))
    ctx = _applying(s, model, optimizer, loader, scheduler, device, distributed, model_applied, count_items)
    if model_applied is not None:
        return _apply_to_another_optimizer(ctx)
    for apply_phase in PHASES.values():
        apply_phase(ctx)
    if ctx.compute is not None:
        ctx.compute.scale_trainable(ctx.bare)  # fp16 scaling from the first backward, compiled or not
    ctx.summary.add("tune", bool(s.tune), "candidates measured before this (see the trials)" if s.tune else "off")
    return ctx.applied()


def _applying(s: Strategy, model, optimizer, loader, scheduler, device, distributed: bool,
              record: Optional[ModelRecord], count_items: Any) -> Applying:
    """The phases' shared state at the start: ``s`` resolved for this run's ranks, the bare model and any DDP
    around it."""
    bare = model.module if is_ddp(model) else model
    ranks = world_size() if distributed else 1
    resolved, derived = resolve_derived(s, ranks)
    return Applying(strategy=resolved, chosen=s, derived=derived, model=model, bare=bare, user_optimizer=optimizer,
                    optimizer=optimizer, loader=loader, scheduler=scheduler, device=model_device(model, device),
                    count_items=count_items, distributed=distributed, ranks=ranks,
                    existing_ddp=_existing_ddp(model, bare, distributed), sharding=sharding_of(bare), record=record,
                    scaler=record.scaler if record is not None else None)


def _existing_ddp(model, bare, distributed: bool):
    """A DistributedDataParallel the script (or a framework: Lightning's DDP strategy) built before optimize()."""
    return model if is_ddp(model) else framework_ddp(bare) if distributed else None


# -- the phases, in the phase table's order --------------------------------------------------------------------
def _switches(ctx: Applying) -> None:
    """The process switches, each from its knob row."""
    for knob in knobs.process_knobs():
        value = getattr(ctx.strategy, knob.path)
        ctx.summary.add(knob.path, value, knob.apply(value, ctx.device))


def _surgery(ctx: Applying) -> None:
    """Module surgery on the bare model; skipped on a DDP the script built (its buckets hold the parameters)."""
    fused_ops = ctx.strategy.fused_ops
    if fused_ops and ctx.existing_ddp is not None:
        _skip_under_users_ddp(ctx.summary, "fused_ops", fused_ops, "the parameters as they are")
    elif fused_ops:
        counts = ops.apply_fused_ops(ctx.bare, fused_ops)
        done = ", ".join(f"{k}: {v} module(s) replaced" for k, v in counts.items() if v)
        none = [k for k, v in counts.items() if not v]
        skipped = f"skipped: no module of {type(ctx.bare).__name__} to fuse for {', '.join(none)}" if none else ""
        ctx.summary.add("fused_ops", fused_ops, "; ".join(part for part in (done, skipped) if part))
    else:
        ctx.summary.add("fused_ops", fused_ops, "none")


def _optimizer(ctx: Applying) -> None:
    """The optimizer swap (``keep``: the given optimizer), and torch's fused step for a kept one."""
    section = ctx.strategy.optimizer
    ctx.optimizer = optim.swap_optimizer(ctx.bare, ctx.user_optimizer, section)
    ctx.summary.add("optimizer", section.name,
                    type(ctx.optimizer).__name__ if ctx.optimizer is not None else "no optimizer")
    if not section.fused:
        return
    if ctx.optimizer is None:
        done = "skipped: no optimizer"
    elif section.name != "keep":
        done = f"skipped: {type(ctx.optimizer).__name__} steps in multi-tensor buckets of its own"
    else:
        done = optim.use_fused_step(ctx.optimizer, ctx.bare, sharded=ctx.sharding is not None or _aiak_shards(ctx))
    ctx.summary.add("optimizer.fused", True, done)


def _channels_last(ctx: Applying) -> None:
    """NHWC memory format; skipped on a DDP the script built (its buckets hold the parameters' layout)."""
    on = ctx.strategy.channels_last
    if on and ctx.existing_ddp is not None:
        _skip_under_users_ddp(ctx.summary, "channels_last", on, "the parameters in their current layout")
    else:
        ctx.summary.add("channels_last", on, apply_channels_last(ctx.bare, ctx.optimizer) if on else "off")


def _precision(ctx: Applying) -> None:
    """O1/O2 on the bare model; fp16's loss scaler only with an optimizer to step (its controller skips overflows).
    Under aiak's FSDP2, O2 is FSDP2's MixedPrecisionPolicy, set by the ddp phase when it shards."""
    s = ctx.strategy
    if s.precision.level == "O2" and _aiak_shards(ctx):
        ctx.summary.add("precision", compact(s.precision, ("level", "dtype")),
                        f"O2 by FSDP2's MixedPrecisionPolicy(param_dtype={s.precision.dtype}, "
                        f"reduce_dtype={s.comm.fsdp.reduce_dtype}): applied with comm.engine fsdp2")
        return
    precision = amp.apply_precision(ctx.bare, s.precision, ctx.device.type, device=ctx.device,
                                    scaled=ctx.optimizer is not None, compiled=bool(s.compile))
    ctx.scaler, ctx.compute = precision.scaler, precision.compute
    ctx.summary.add("precision", compact(s.precision, ("level", "dtype")), precision.describe())
    if precision.fp8 is not None:
        ctx.summary.add("precision.fp8", s.precision.fp8, precision.fp8.detail())


def _step_controller(ctx: Applying) -> None:
    """The scheduler re-pointed to a swapped optimizer, and the step controller when the steps need one
    (accumulation, loss scaling, `_steps_need_control`); for another optimizer of an optimized model, the
    controller steps under the DDP the model already has."""
    s = ctx.strategy
    if ctx.scheduler is not None and ctx.optimizer is not ctx.user_optimizer:
        optim.rebind_scheduler(ctx.scheduler, ctx.user_optimizer, ctx.optimizer)
    if ctx.optimizer is not None and (ctx.scaler is not None or s.grad_accumulation > 1 or _steps_need_control(ctx)):
        ctx.controller = StepController(ctx.optimizer, s.grad_accumulation, ctx.scaler, model=ctx.bare)
    ctx.summary.add("grad_accumulation", s.grad_accumulation,
                    f"optimizer steps every {s.grad_accumulation} step() calls" if s.grad_accumulation > 1 else "off")
    if ctx.scheduler is not None and ctx.controller is not None:
        ctx.controller.attach_scheduler(ctx.scheduler)
    if ctx.record is not None and ctx.controller is not None and ctx.existing_ddp is not None:
        ctx.controller.attach_ddp(ctx.existing_ddp)


def _ddp(ctx: Applying) -> None:
    """DDP and its communication hook (a DDP the script built gets the hook; a framework's stays the framework's:
    the module comes back as it was given), the step controller told of them. A model the script sharded is never
    wrapped: its engine synchronises the gradients, and the step controller turns FSDP2's switches
    (`aiak.comm.sharded`)."""
    if ctx.sharding is not None:
        _under_the_scripts_sharding(ctx)
        return
    if _aiak_shards(ctx):
        _shard_with_fsdp2(ctx)
        return
    if ctx.strategy.comm.engine == "fsdp2" and ctx.distributed:
        warn.warn_once("fsdp2-one-process", "aiak: comm.engine fsdp2 on one process: nothing to shard (it shards "
                                            "over the ranks of torchrun); the model trains unsharded")
    _check_the_comm_has_its_controller(ctx)
    target = ctx.existing_ddp or ctx.model
    wrapped = comm.wrap_distributed(target, ctx.strategy.comm, ctx.device) if ctx.distributed else ctx.model
    if wrapped is not ctx.bare and ctx.controller is not None:
        _attach_comm(ctx.controller, wrapped)
    if ctx.count_items and is_ddp(wrapped):
        comm.refuse_join(wrapped, COUNTED_UNDER_JOIN)
    ctx.summary.add("comm", compact(ctx.chosen.comm, ("algorithm", "hierarchical", "compression", "bucket_mb")),
                    _describe_comm(wrapped, ctx.bare))
    if ctx.existing_ddp is None or ctx.existing_ddp is ctx.model:
        ctx.model = wrapped


def _aiak_shards(ctx: Applying) -> bool:
    """``comm.engine: fsdp2`` on several ranks, on a model nobody sharded yet."""
    return ctx.strategy.comm.engine == "fsdp2" and ctx.distributed and ctx.ranks > 1 and ctx.sharding is None


def _shard_with_fsdp2(ctx: Applying) -> None:
    """The ddp phase under ``comm.engine: fsdp2`` (`aiak.comm.fsdp`): the bare model sharded unit by unit, the
    optimizer pointed at the sharded parameters (its state sharded too), the step controller turning FSDP2's
    switches. The model comes back sharded (no DDP)."""
    if ctx.existing_ddp is not None:
        raise ValueError("aiak: comm.engine fsdp2 shards the model, and it is already a DistributedDataParallel: pass "
                         "aiak.optimize the model itself (aiak shards it), or leave comm.engine at ddp")
    s = ctx.strategy
    before = dict(ctx.bare.named_parameters())
    units = fsdp.sharding_units(ctx.bare, s.comm.fsdp.units)
    unit_classes = sorted({type(u).__name__ for u in units})
    fsdp.shard(ctx.bare, units, s.comm.fsdp, s.precision.dtype if s.precision.level == "O2" else None, ctx.device)
    after = dict(ctx.bare.named_parameters())
    swapped = fsdp.repoint_optimizer(ctx.optimizer, before, after) if ctx.optimizer is not None else 0
    if ctx.controller is not None:
        ctx.controller.attach_ddp(FSDPSync(ctx.bare))
    ctx.summary.add("comm", compact(ctx.chosen.comm, ("engine",)),
                    f"FSDP2 over {ctx.ranks} ranks: {len(units)} units ({', '.join(unit_classes) or 'none'}) and the "
                    f"root; {swapped} parameters of the optimizer re-pointed to their shards")
    ctx.model = ctx.bare


def _under_the_scripts_sharding(ctx: Applying) -> None:
    """The ddp phase on a model the script sharded: no DDP; under FSDP2 the step controller keeps micro-steps
    from reduce-scattering and sums counted items over FSDP's ranks."""
    engine = ENGINE_NAMES[ctx.sharding]
    if ctx.sharding == FSDP2 and ctx.controller is not None and ctx.distributed:
        sync = FSDPSync(ctx.bare)
        if ctx.count_items and sync.group_problem:
            raise ValueError(sync.group_problem)
        ctx.controller.attach_ddp(sync)
        effect = f"no DDP: the model is sharded by {engine}, which reduce-scatters the gradients"
        if ctx.strategy.grad_accumulation > 1:
            effect += "; micro-steps keep theirs (FSDP's set_requires_gradient_sync)"
    else:
        effect = f"no DDP: the model is sharded by {engine}, which synchronises the gradients"
    ctx.summary.add("comm", compact(ctx.chosen.comm, ("algorithm",)), effect)


COUNTED_UNDER_JOIN = (
    "aiak: DistributedDataParallel.join() (uneven inputs) does not run with counted items (aiak.optimize(..., "
    "count_items=...)): at each optimizer step the ranks sum the window's items, a collective Join does not shadow, "
    "so a rank that ran out of batches would leave the others waiting for it. Give every rank the same number of "
    "batches (a DistributedSampler with drop_last=True, or stop all ranks at the shortest), or leave count_items out "
    "to train uneven inputs under join()")


def _compile(ctx: Applying) -> None:
    """``torch.compile`` in place, last of the model's phases."""
    on = ctx.strategy.compile
    ctx.summary.add("compile", on, apply_compile(ctx.model, ctx.device) if on else "off")


def _loader(ctx: Applying) -> None:
    """The loader wrapped, last (`_wrap_loader`)."""
    ctx.loader = _wrap_loader(ctx.strategy, ctx.loader, ctx.device, ctx.controller, ctx.count_items, ctx.summary)


PHASES: Dict[str, Callable[[Applying], None]] = {
    "switches": _switches,
    "surgery": _surgery,
    "optimizer": _optimizer,
    "channels_last": _channels_last,
    "precision": _precision,
    "step_controller": _step_controller,
    "ddp": _ddp,
    "compile": _compile,
    "loader": _loader,
}
PER_OPTIMIZER = phases.per_optimizer()   # the phases another optimizer of an optimized model gets


# -- what the phases decide from several knobs -----------------------------------------------------------------
def _steps_need_control(ctx: Applying) -> bool:
    """Beyond accumulation and loss scaling, a step controller is needed for counted items and, on the model's
    first ``optimize()``, for a comm algorithm that acts at real steps or int8's residuals (both kept with the
    optimizer's state)."""
    return ctx.record is None and (_synchronising(ctx) or _keeps_residuals(ctx)) or bool(ctx.count_items)


def _synchronising(ctx: Applying) -> bool:
    """The comm algorithm acts at real optimizer steps (the step controller calls it)."""
    return ctx.ranks > 1 and algorithm_class(ctx.strategy.comm.algorithm).steps_with_optimizer


def _keeps_residuals(ctx: Applying) -> bool:
    """int8 compression keeps error-feedback residuals, saved with the optimizer's state (the controller's extras)."""
    c = ctx.strategy.comm
    return ctx.ranks > 1 and (c.compression == "int8" or c.autotune and c.tune_int8)


def _check_the_comm_has_its_controller(ctx: Applying) -> None:
    """A comm algorithm acting at real steps needs the optimizer's controller (refused without); int8's residuals
    want it (warned without)."""
    if _synchronising(ctx) and ctx.controller is None:
        raise ValueError(f"comm.algorithm {ctx.strategy.comm.algorithm} runs with the optimizer's steps (and saves "
                         "its state in the optimizer's state_dict): pass the optimizer to aiak.optimize, or use "
                         "algorithm allreduce")
    if _keeps_residuals(ctx) and ctx.controller is None:
        warn.warn("aiak.comm: int8 compression keeps error-feedback residuals from step to step, and they "
                      "are saved in the optimizer's state_dict(): without the optimizer given to aiak.optimize a "
                      "checkpoint leaves them out and a resumed run differs from an uninterrupted one. Pass the "
                      "optimizer to aiak.optimize")


def _attach_comm(controller: StepController, wrapped) -> None:
    """The step controller told of the DDP, its comm algorithm and its hook's state."""
    controller.attach_ddp(wrapped)
    if getattr(wrapped, "aiak_comm_algorithm", None) is not None:
        controller.attach_comm_algorithm(wrapped.aiak_comm_algorithm)
    if getattr(wrapped, "aiak_comm_state", None) is not None:
        controller.attach_comm_state(wrapped.aiak_comm_state)


# -- another optimizer of a model optimized before ---------------------------------------------------------------
def _apply_to_another_optimizer(ctx: Applying) -> Applied:
    """The phases of one optimizer (`PER_OPTIMIZER`), for a model optimized before: its model-level knobs
    are kept as the first ``optimize()`` applied them, its loss scaler shared."""
    algorithm = getattr(ctx.model, "aiak_comm_algorithm", None)
    if algorithm is not None and ctx.user_optimizer is not None:
        raise ValueError(f"this model synchronises with {algorithm.describe()} at the steps of the optimizer it was "
                         "first optimized with; a second optimizer would synchronise it twice per step: pass all "
                         "parameter groups in one optimizer, or use comm.algorithm allreduce")
    for knob in MODEL_KNOBS:
        ctx.summary.add(knob, getattr(ctx.chosen, knob), "kept as the first optimize() call of this model applied it")
    for name in PER_OPTIMIZER:
        PHASES[name](ctx)
    return ctx.applied()


def _wrap_loader(s: Strategy, loader, dev, controller: Optional[StepController], count_items: Any,
                 summary: Summary):
    """The loader phase: the strategy's ``loader:`` section, then what the step controller follows: the batches
    handed out, for windows closed at the step that trains each epoch's last batch under accumulation and each
    batch's items counted with a ``count_items`` function (`aiak.loaders.WindowLoader`). Without a loader
    the windows cannot see an epoch end: the controller says so at its first step, if no framework's accumulation
    took over by then."""
    accumulation = controller.accumulation if controller is not None else 1
    if loader is None:
        summary.add("loader", compact(s.loader, ("prefetch", "pin_memory", "balanced")), "no loader")
        return None
    if controller is not None:
        controller.sees_epoch_ends = True
    count = count_items if callable(count_items) else None
    unpinned = loaders.pinning_skipped(loader, s.loader, dev)
    loader = loaders.wrap_loader(loader, s.loader, dev, channels_last=s.channels_last, accumulation=accumulation,
                                 follower=controller.follow_loader(counts=count is not None)
                                 if controller is not None else None, count=count)
    if controller is not None:
        controller.coming_step_closes()  # (the loader's epoch is known now: an epoch of one batch closes at once)
    inner = loader.loader if isinstance(loader, loaders.WindowLoader) else loader
    signals = [what for what, on in (("windows closed at each epoch's end", accumulation > 1),
                                     ("items counted per batch", count is not None)) if on]
    applied = compact(s.loader, ("prefetch", "pin_memory", "balanced"))
    if unpinned is not None:  # its own line first: the decision record reads a knob's effect from it
        summary.add("loader.pin_memory", True, f"skipped ({unpinned})")
        applied["pin_memory"] = False
    summary.add("loader", applied, type(inner).__name__ + (f"; {', '.join(signals)}" if signals else ""))
    return loader


def _skip_under_users_ddp(summary: Summary, knob: str, value: Any, buckets_hold: str) -> None:
    warn.warn(f"aiak: {knob} skipped: the model is already a DistributedDataParallel, whose buckets hold "
                  f"{buckets_hold}; call aiak.optimize before wrapping the model in DDP (aiak wraps it itself under "
                  "torchrun)")
    summary.add(knob, value, "skipped: the model was already wrapped in DDP")


def is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _describe_comm(wrapped: nn.Module, model: nn.Module) -> str:
    if wrapped is model:
        return "single process: no DDP"
    return f"DDP, {comm.describe_comm(wrapped)}"
