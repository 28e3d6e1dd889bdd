"""``aiak.optimize``: chooses a strategy (the rules, then the trials), applies it through `aiak.apply` inside a
snapshot (all or nothing), records the decision and says what was applied; ``explain`` says what it would do."""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Tuple, Union

from torch import nn

from aiak.amp.fp8 import plan_fp8
from aiak.apply import MODEL_KNOBS, ModelRecord, Summary, apply_strategy, is_ddp
from aiak.loaders.distributed_hints import warn_if_unsharded
from aiak.runtime.marks import mark, marked
from aiak.runtime.rollback import Snapshot
from aiak.step.wrappers import rewrap_optimizer, unwrap_optimizer
from aiak.strategy.derived import resolve_derived
from aiak.strategy.schema import Strategy
from aiak.strategy.select import resolve_strategy
from aiak.strategy.sharded import check_sharded, sharded_by
from aiak.runtime.switches import read_switches
from aiak.tune import decision as decisions
from aiak.tune import guard
from aiak.tune.trials import run_trials
from aiak.util import warn
from aiak.util.arguments import check_arguments, check_unpacking, refuse_replaced_parameters
from aiak.util.machine.devices import model_device

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger("aiak")


def optimize(model: nn.Module, optimizer: Optional[Optimizer] = None, loader: Optional[Iterable] = None, *,
             strategy: Union[str, os.PathLike, Mapping[str, Any], Strategy] = "auto",
             scheduler: Optional[LRScheduler] = None, device: Union[str, torch.device, None] = None,
             count_items: Union[None, bool, Callable[[Any], Any]] = None) -> Tuple[Any, ...]:
    """Apply a strategy to a training setup, and return the same objects, patched in place or wrapped.

    The training loop stays as it was (``loss.backward(); optimizer.step(); optimizer.zero_grad()``): what a strategy
    changes is reached through the objects the script already holds. With ``tune`` on (the default for ``"auto"``),
    candidate strategies are first timed on copies of the model and optimizer and on the loader's first batches, which
    the returned loader then yields first; [aiak.last_decision][aiak.api.last_decision] says what was chosen and why.

    All or nothing: the arguments (their order, an optimizer or a scheduler of another model) and the strategy are
    validated before anything is touched, and if a later step fails, the model, optimizer, scheduler and loader are
    put back exactly as they were (`aiak.runtime.rollback`) before the error propagates. A framework's optimizer
    wrapper (Accelerate's `AcceleratedOptimizer`, Lightning's `LightningOptimizer`) is seen through: the optimizer
    inside is the one patched, and the wrapper comes back.

    Args:
        model: the model to train (a `torch.nn.Module`, or a DDP or FSDP2 model the script built).
        optimizer: the model's optimizer, or a framework's wrapper of it; None to optimize the model alone.
        loader: any re-iterable of batches (a `DataLoader`, a DALI iterator, a list); None to leave loading alone.
        strategy: `"auto"` (rules, then trials), a built-in profile name (`aiak profiles` lists them), a YAML path,
            a dict of the YAML's shape or an [aiak.Strategy][aiak.strategy.schema.Strategy].
        scheduler: a learning-rate scheduler built on `optimizer`; under `grad_accumulation` it advances once per
            real step.
        device: where to move the model first (default: where its parameters already are).
        count_items: a function of a batch returning the items its loss averages over (a causal language model's
            `lambda b: (b["labels"][:, 1:] != -100).sum()`, a masked one's `lambda b: (b["labels"] != -100).sum()`),
            called by the returned loader for each batch; or `True` when the script calls
            [aiak.count_items][aiak.step.controller.count_items] itself. Accumulation windows (and, under DDP, the
            ranks' gradients) are then averaged by items: the big batch's gradient for mean-over-items losses.

    Returns:
        `(model, optimizer, loader)`, plus `scheduler` when one was given: the same objects, patched in place or
            wrapped, each None where it was not given, so a script always unpacks three names (four with a
            scheduler).

    Raises:
        StrategyError: the strategy is bad: an unknown profile, a YAML file that cannot be read, an unknown key, a
            wrong type or value, an impossible combination (every mistake at once, each naming its file and key
            path; a `ValueError`).
        TypeError: the arguments are in the wrong order or of the wrong kind (the first is not a model, the second
            not an optimizer), `count_items` is neither a function nor True, or the calling line unpacks the result
            into another number of names than `optimize` returns.
        ValueError: the optimizer holds none of the model's parameters, the scheduler was built on another
            optimizer, `count_items` lacks the optimizer (or, as a function, the loader) it weighs, or a second call
            for a model optimized before asks for other model-level knobs.
    """
    check_unpacking(scheduler is not None)
    _check_count_items(count_items, optimizer, loader)
    given_optimizer, (optimizer, wrappers) = optimizer, unwrap_optimizer(optimizer)
    check_arguments(model, optimizer, scheduler, loader)
    bare = model.module if is_ddp(model) else model  # a DDP the script built: the strategy is chosen for its model
    before: Optional[ModelRecord] = marked(bare, "_aiak_applied")
    if before is not None:  # a second optimizer for a model optimized before
        selection = None
        s = before.strategy if _is_auto(strategy) else _same_model_knobs(
            resolve_strategy(strategy, bare, optimizer, loader, device=device).strategy, before.strategy)
    else:
        selection = resolve_strategy(strategy, bare, optimizer, loader, device=device)
        s = selection.strategy
        sharding = sharded_by(s.to_dict(), selection.probes.sharding, selection.probes.world_size)
        if sharding:  # a model the script sharded, or aiak will: what cannot compose is refused, before trials
            check_sharded(s.to_dict(), sharding, s.name, count_items)
    tuning, given_loader = None, loader
    if s.tune and before is None:
        tuning = run_trials(selection, bare, optimizer, loader, model_device(model, device))
        s, loader = tuning.strategy, tuning.loader
    snapshot = Snapshot(model, optimizer, scheduler, given_loader, given_optimizer)
    plain_switches = read_switches()  # plain PyTorch's: what the run-time guard times the pick against
    try:
        applied = apply_strategy(s, model, optimizer, loader, scheduler, device, model_applied=before,
                                 count_items=count_items or None)
    except BaseException:
        snapshot.restore()
        if tuning is not None and tuning.restore_rng is not None:
            tuning.restore_rng()
        raise
    if before is None:
        decision = decisions.build(selection, s, tuning, applied.summary, _comm_tuning(applied.model),
                                   derived=applied.derived)
        if bare is not None:
            mark(bare, "_aiak_applied", ModelRecord(s, applied.scaler, decision))
    else:
        decision = replace(before.decision, strategy=s.to_dict(), effects=[list(e) for e in applied.summary.lines],
                           tuning="not run: the model was optimized by an earlier optimize() call, whose strategy "
                                  "it keeps", comm=_comm_tuning(applied.model) or before.decision.comm)
    if before is None:
        guard.watch(tuning, s, bare, applied.optimizer, plain_switches, model_device(model, device), decision)
    decisions.record(decision)
    logger.info("%s", decision.render())
    _say_what_was_applied(decision)
    warn_if_unsharded(applied.loader)
    refuse_replaced_parameters(bare, applied.optimizer)
    result = (applied.model, rewrap_optimizer(wrappers, applied.optimizer), applied.loader)
    return result + (scheduler,) if scheduler is not None else result


def _check_count_items(count_items: Any, optimizer, loader) -> None:
    """``count_items`` is None, a bool or a function, with what it needs (checked before anything is applied)."""
    if count_items is None or count_items is False:
        return
    if not (count_items is True or callable(count_items)):
        raise TypeError(f"aiak.optimize: count_items must be a function of a batch (the items its loss averages "
                        f"over), True (the script calls aiak.count_items) or None; got {type(count_items).__name__}")
    if optimizer is None:
        raise ValueError("aiak.optimize: count_items weighs the optimizer's accumulation windows by items: pass the "
                         "optimizer too")
    if callable(count_items) and loader is None:
        raise ValueError("aiak.optimize: count_items=fn is called by the loader aiak returns, for each batch: pass the "
                         "loader too (or count_items=True and call aiak.count_items(optimizer, n) in the loop)")


def _comm_tuning(model: nn.Module):
    """The comm autotuner's record of the DDP ``optimize()`` built (None without one, or without autotuning)."""
    return getattr(getattr(model, "aiak_comm_state", None), "tuning", None)


def _is_auto(strategy: Any) -> bool:
    return isinstance(strategy, str) and strategy == "auto"


def _same_model_knobs(s: Strategy, first: Strategy) -> Strategy:
    """``s`` for another optimizer of a model optimized with ``first``: the model-level knobs must agree."""
    differ = [k for k in MODEL_KNOBS if getattr(s, k) != getattr(first, k)]
    if differ:
        raise ValueError(
            f"aiak.optimize: this model was optimized before with {first.called}; {s.called} for this call "
            f"differs in {', '.join(differ)}, which apply to the model, not to one optimizer. Give this "
            "call strategy='auto' (it keeps the first call's), or the same values for those knobs; only optimizer, "
            "grad_accumulation and loader may differ per optimizer")
    return s


def _say_what_was_applied(decision) -> None:
    """Two lines on rank 0's stderr, however the script configured logging (the full table stays at INFO on the
    ``aiak`` logger): what was applied, and where to read why."""
    if warn.is_rank_zero():
        print(decision.headline(), file=sys.stderr, flush=True)


def explain(model: Optional[nn.Module], optimizer: Optional[Optimizer] = None, loader: Optional[Iterable] = None, *,
            strategy: Union[str, os.PathLike, Mapping[str, Any], Strategy] = "auto", tune: bool = False,
            device: Union[str, torch.device, None] = None) -> "decisions.Decision":
    """What `strategy` would apply to these objects, knob by knob, and why.

    The record [aiak.optimize][aiak.api.optimize] would make, without applying anything: the way to read a choice
    before training with it (`aiak explain` prints it for a model spec).

    Args:
        model: the model (None: the rules judge the machine alone).
        optimizer: its optimizer, or None.
        loader: its loader, or None.
        strategy: as [aiak.optimize][aiak.api.optimize]'s.
        tune: False: the rules' pick only; nothing is measured and the objects are not changed. True:
            [aiak.optimize][aiak.api.optimize] runs on the objects (trials included) and its record is returned.
        device: as [aiak.optimize][aiak.api.optimize]'s.

    Returns:
        The decision record: every knob with its value, source and reason (`.render()` is the table,
            `.to_dict()` is JSON-ready).

    Raises:
        StrategyError: the strategy is bad (as [aiak.optimize][aiak.api.optimize] raises it).
    """
    if tune:
        optimize(model, optimizer, loader, strategy=strategy, device=device)
        return decisions.last_decision()
    selection = resolve_strategy(strategy, model, optimizer, loader, device=device)
    _, derived = resolve_derived(selection.strategy, selection.probes.world_size)  # as optimize() would
    record = decisions.build(selection, selection.strategy, None, _planned(selection.strategy, model),
                             derived=derived)
    if selection.strategy.tune:
        record.tuning = "not measured here (aiak explain --tune measures the candidates)"
    return record


def _planned(strategy, model) -> Optional[Summary]:
    """What ``optimize()`` would say it did to the model's layers, without doing it: fp8's layer plan."""
    if model is None or strategy.precision.fp8 == "off":
        return None
    summary = Summary()
    plan = plan_fp8(model, strategy.precision.fp8, strategy.precision.fp8_skip)
    summary.add("precision.fp8", strategy.precision.fp8, f"would convert {plan.detail()}")
    return summary


def last_decision() -> Optional["decisions.Decision"]:
    """The record of the most recent [aiak.optimize][aiak.api.optimize] in this process.

    What a script (or a test outside aiak) reads to know what was applied and why, without parsing the log.

    Returns:
        The decision record (strategy, every knob with its source and reason, the trials; `.to_dict()` is
            JSON-ready, `.render()` the table), or None before the first `optimize()`.
    """
    return decisions.last_decision()
