"""The one applier of a strategy: switches, module surgery, optimizer and precision, the step controller, DDP,
compile, loader, in that order, each step writing what it did into a :class:`Summary`.

``aiak.optimize()`` calls :func:`apply_strategy` inside a :class:`~aiak.runtime.rollback.Snapshot` (all or nothing), and
the trials (:mod:`aiak.tune.trials`) call it on their copies with ``distributed=False``, so a candidate is timed
exactly as it would be applied.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from torch import nn

from aiak import amp, comm, loaders, ops, optim
from aiak.step.controller import StepController
from aiak.step.framework_ddp import framework_ddp
from aiak.strategy import knobs
from aiak.strategy.schema import Strategy
from aiak.util import warn as amp_warn
from aiak.util.devices import model_device
from aiak.util.dist import world_size
from aiak.util.text import yaml_text


@dataclass
class Summary:
    """What each step of :func:`apply_strategy` did, knob by knob: the "applied" part of the decision record."""

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
    ``configure_optimizers`` again for a second ``fit``. Model-level knobs (:data:`MODEL_KNOBS`) are applied once;
    each optimizer gets its own step controller, sharing the model's loss scaler."""

    strategy: Strategy
    scaler: Any                   # the model's LossScaler (fp16), or None
    decision: Any                 # the decision record of that call


@dataclass
class Applied:
    """What :func:`apply_strategy` returns: the (possibly wrapped) objects, the summary and the step controller."""

    model: Any
    optimizer: Any
    loader: Any
    summary: Summary
    controller: Optional[StepController]
    scaler: Any = None


def apply_strategy(s: Strategy, model: nn.Module, optimizer, loader, scheduler, device,
                   *, distributed: bool = True, model_applied: Optional[ModelRecord] = None,
                   count_items: Any = None) -> Applied:
    """Steps 2-7 of applying a validated strategy (switches, surgery, optimizer and precision, DDP, compile,
    loader).

    The one place a strategy is applied: ``optimize()`` calls it (inside a :class:`~aiak.runtime.rollback.Snapshot`),
    and so do the trials (:mod:`aiak.tune.trials`, on copies, with ``distributed=False``: no DDP wrapping).
    ``model_applied``: the model was optimized before (see :class:`ModelRecord`); only the optimizer's and the
    loader's steps run. ``count_items``: ``True`` (the script calls ``aiak.count_items``) or a function of a batch
    the loader calls (:func:`_wrap_loader`); either way the optimizer gets a step controller.
    """
    if model_applied is not None:
        return _apply_to_another_optimizer(s, model, optimizer, loader, scheduler, device, model_applied,
                                           count_items)
    dev = model_device(model, device)
    if model is not None and device is not None:
        model.to(dev)
    summary = Summary()
    bare = model.module if is_ddp(model) else model
    # a DistributedDataParallel the script (or a framework: Lightning's DDP strategy) built before optimize()
    existing_ddp = model if is_ddp(model) else framework_ddp(bare) if distributed else None
    wrapped_by_user = existing_ddp is not None

    # 2. process switches (the knob table's process rows)
    for knob in knobs.process_knobs():
        value = getattr(s, knob.path)
        summary.add(knob.path, value, knob.apply(value, dev))

    # 3. module surgery on the bare model
    if s.fused_ops and wrapped_by_user:
        _skip_under_users_ddp(summary, "fused_ops", s.fused_ops, "the parameters as they are")
    elif s.fused_ops:
        counts = ops.apply_fused_ops(bare, s.fused_ops)
        done = ", ".join(f"{k}: {v} module(s) replaced" for k, v in counts.items() if v)
        none = [k for k, v in counts.items() if not v]
        skipped = f"skipped: no module of {type(bare).__name__} to fuse for {', '.join(none)}" if none else ""
        summary.add("fused_ops", s.fused_ops, "; ".join(part for part in (done, skipped) if part))
    else:
        summary.add("fused_ops", s.fused_ops, "none")

    # 4. optimizer swap, memory format, precision; the step controller owns optimizer.step()
    user_optimizer, optimizer = optimizer, optim.swap_optimizer(bare, optimizer, s.optimizer)
    summary.add("optimizer", s.optimizer.name, type(optimizer).__name__ if optimizer is not None else "no optimizer")
    if s.channels_last and wrapped_by_user:
        _skip_under_users_ddp(summary, "channels_last", s.channels_last, "the parameters in their current layout")
    else:
        summary.add("channels_last", s.channels_last, amp.apply_channels_last(bare) if s.channels_last else "off")
    precision = amp.apply_precision(bare, s.precision, dev.type, device=dev, scaled=optimizer is not None)
    summary.add("precision", compact(s.precision, ("level", "dtype")), precision.describe())
    many_ranks = distributed and world_size() > 1
    synchronising = many_ranks and s.comm.algorithm != "allreduce"
    # int8 keeps error-feedback residuals, saved with the optimizer's state (the step controller's extras)
    residuals = many_ranks and (s.comm.compression == "int8" or s.comm.autotune and s.comm.tune_int8)
    controller = _control_steps(s, bare, user_optimizer, optimizer, scheduler, precision.scaler, summary,
                                always=synchronising or residuals or bool(count_items))

    # 5. distributed wrapping and communication hook (O2's gradients travel in its half dtype, as apex's did)
    comm_cfg = s.comm
    if s.precision.level == "O2" and s.comm.compression == "none" and many_ranks \
            and s.comm.algorithm in ("allreduce", "local_sgd"):
        comm_cfg = replace(s.comm, compression=s.precision.dtype)
    if synchronising and controller is None:
        raise ValueError(f"comm.algorithm {s.comm.algorithm} runs with the optimizer's steps (and saves its state in "
                         "the optimizer's state_dict): pass the optimizer to aiak.optimize, or use algorithm allreduce")
    if residuals and controller is None:
        amp_warn.warn("aiak.comm: int8 compression keeps error-feedback residuals from step to step, and they "
                      "are saved in the optimizer's state_dict(): without the optimizer given to aiak.optimize a "
                      "checkpoint leaves them out and a resumed run differs from an uninterrupted one. Pass the "
                      "optimizer to aiak.optimize")
    wrapped = comm.wrap_distributed(existing_ddp or model, comm_cfg, dev) if distributed else model
    if wrapped is not bare and controller is not None:
        controller.attach_ddp(wrapped)
        if getattr(wrapped, "aiak_comm_algorithm", None) is not None:
            controller.attach_comm_algorithm(wrapped.aiak_comm_algorithm)
        if getattr(wrapped, "aiak_comm_state", None) is not None:
            controller.attach_comm_state(wrapped.aiak_comm_state)
    summary.add("comm", compact(s.comm, ("algorithm", "hierarchical", "compression", "bucket_mb")),
                _describe_comm(wrapped, bare))
    if existing_ddp is None or existing_ddp is model:
        model = wrapped  # (a framework's DDP stays the framework's: the module comes back as it was given)

    # 6. torch.compile last
    summary.add("compile", s.compile, amp.apply_compile(model, dev) if s.compile else "off")

    # 7. loader
    loader = _wrap_loader(s, loader, dev, controller, count_items, summary)

    summary.add("tune", bool(s.tune), "candidates measured before this (see the trials)" if s.tune else "off")
    return Applied(model, optimizer, loader, summary, controller, precision.scaler)


def _control_steps(s: Strategy, bare, user_optimizer, optimizer, scheduler, scaler, summary: Summary,
                   always: bool = False):
    """The scheduler re-pointed to a swapped optimizer, and the step controller (accumulation, loss scaling, and
    ``always`` for a comm algorithm that acts at real steps)."""
    if scheduler is not None and optimizer is not user_optimizer:
        optim.rebind_scheduler(scheduler, user_optimizer, optimizer)
    controller = None
    if optimizer is not None and (scaler is not None or s.grad_accumulation > 1 or always):
        controller = StepController(optimizer, s.grad_accumulation, scaler, model=bare)
    summary.add("grad_accumulation", s.grad_accumulation,
                f"optimizer steps every {s.grad_accumulation} step() calls" if s.grad_accumulation > 1 else "off")
    if scheduler is not None and controller is not None:
        controller.attach_scheduler(scheduler)
    return controller


def _apply_to_another_optimizer(s: Strategy, model, optimizer, loader, scheduler, device,
                                record: ModelRecord, count_items: Any = None) -> Applied:
    """The optimizer's and the loader's steps of :func:`apply_strategy`, for a model optimized before."""
    summary = Summary()
    bare = model.module if is_ddp(model) else model
    algorithm = getattr(model, "aiak_comm_algorithm", None)
    if algorithm is not None and optimizer is not None:
        raise ValueError(f"this model synchronises with {algorithm.describe()} at the steps of the optimizer it was "
                         "first optimized with; a second optimizer would synchronise it twice per step: pass all "
                         "parameter groups in one optimizer, or use comm.algorithm allreduce")
    for knob in MODEL_KNOBS:
        summary.add(knob, getattr(s, knob), "kept as the first optimize() call of this model applied it")
    user_optimizer, optimizer = optimizer, optim.swap_optimizer(bare, optimizer, s.optimizer)
    summary.add("optimizer", s.optimizer.name, type(optimizer).__name__ if optimizer is not None else "no optimizer")
    controller = _control_steps(s, bare, user_optimizer, optimizer, scheduler, record.scaler, summary,
                                always=bool(count_items))
    ddp = model if is_ddp(model) else framework_ddp(bare)
    if controller is not None and ddp is not None:
        controller.attach_ddp(ddp)
    loader = _wrap_loader(s, loader, model_device(model, device), controller, count_items, summary)
    return Applied(model, optimizer, loader, summary, controller, record.scaler)


def _wrap_loader(s: Strategy, loader, dev, controller: Optional[StepController], count_items: Any,
                 summary: Summary):
    """Step 7: the strategy's ``loader:`` section, then the step controller's signals: windows closed at each
    epoch's end under accumulation, each batch's items counted with a ``count_items`` function
    (:class:`aiak.loaders.WindowLoader`). Without a loader the windows cannot see an epoch end: the controller
    says so at its first step, if no framework's accumulation took over by then."""
    accumulation = controller.accumulation if controller is not None else 1
    if loader is None:
        summary.add("loader", compact(s.loader, ("prefetch", "pin_memory", "balanced")), "no loader")
        return None
    if controller is not None:
        controller.sees_epoch_ends = True
    count = count_items if callable(count_items) else None
    loader = loaders.wrap_loader(loader, s.loader, dev, channels_last=s.channels_last, accumulation=accumulation,
                                 close_window=controller.close_window if controller is not None else None,
                                 count=count, counted=controller.count_items if count is not None else None)
    inner = loader.loader if isinstance(loader, loaders.WindowLoader) else loader
    signals = [what for what, on in (("windows closed at each epoch's end", accumulation > 1),
                                     ("items counted per batch", count is not None)) if on]
    summary.add("loader", compact(s.loader, ("prefetch", "pin_memory", "balanced")),
                type(inner).__name__ + (f"; {', '.join(signals)}" if signals else ""))
    return loader


def _skip_under_users_ddp(summary: Summary, knob: str, value: Any, buckets_hold: str) -> None:
    amp_warn.warn(f"aiak: {knob} skipped: the model is already a DistributedDataParallel, whose buckets hold "
                  f"{buckets_hold}; call aiak.optimize before wrapping the model in DDP (aiak wraps it itself under "
                  "torchrun)")
    summary.add(knob, value, "skipped: the model was already wrapped in DDP")


def is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _describe_comm(wrapped: nn.Module, model: nn.Module) -> str:
    if wrapped is model:
        return "single process: no DDP"
    return f"DDP, {comm.describe_comm(wrapped)}"
