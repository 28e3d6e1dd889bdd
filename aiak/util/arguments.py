"""The objects a script hands to ``aiak.optimize``, checked before anything is chosen or applied.

A setup that cannot train as the script means it is said at once, in one error naming which argument is which,
instead of being accepted (and a strategy applied to the wrong model) or failing deep inside with a raw
``AttributeError``:

* arguments in the wrong order (``aiak.optimize(optimizer, model, loader)``), or a model that is not a module;
* a learning-rate scheduler passed positionally (``aiak.optimize(model, optimizer, scheduler)``): it lands in the
  loader's slot (or the optimizer's) and would come back as the "loader"; it goes in as ``scheduler=``;
* an optimizer that holds none of the model's parameters (built for another model, or before the model was
  replaced): training would update that other model;
* a scheduler built on another optimizer: it would change another optimizer's learning rate.

The same holds after ``optimize()``: a script that shards the model afterwards (``fully_shard`` replaces every
parameter it shards with a new DTensor parameter) leaves the returned optimizer holding the old ones, and would train
nothing. `refuse_replaced_parameters` looks once, at the optimizer's first step, and says so.

A model none of whose parameters trains now while an optimizer is given is said once as a warning: a backbone
frozen for its first epochs and unfrozen later is a legitimate script.

What ``optimize`` returns is fixed: ``(model, optimizer, loader)``, ``None`` in the place of what was not given,
plus the scheduler when one was, so a script unpacks it the same way whatever it passes. A call unpacked into
another number of names (``model, optimizer = aiak.optimize(model, optimizer)``) would fail with Python's bare
"too many values to unpack" after everything was applied; `check_unpacking` reads the calling line's
unpacking (its ``UNPACK_SEQUENCE`` instruction) first and says what ``optimize`` returns instead.
"""
from __future__ import annotations

import dis
import sys
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from aiak.util.dist import is_dtensor
from aiak.util.warn import warn_once

CALL = "aiak.optimize(model, optimizer=None, loader=None, *, strategy=..., scheduler=None)"


def check_arguments(model: Any, optimizer: Optional[Any], scheduler: Optional[Any] = None,
                    loader: Optional[Any] = None) -> None:
    """Raise one ``TypeError`` / ``ValueError`` for a setup that cannot be what the script means (see the module
    docstring); ``optimizer`` is the optimizer itself (a framework's wrapper already seen through)."""
    if not isinstance(model, nn.Module):
        if isinstance(model, Optimizer) and isinstance(optimizer, nn.Module):
            raise TypeError(f"{CALL}: the arguments are in the wrong order: the first is an optimizer "
                            f"({type(model).__name__}) and the second a model ({type(optimizer).__name__}); call "
                            "aiak.optimize(model, optimizer, loader)")
        raise TypeError(f"{CALL}: the first argument must be the model (a torch.nn.Module), got "
                        f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        if _is_scheduler(optimizer):
            raise TypeError(f"{CALL}: the second argument (optimizer) is a learning-rate scheduler "
                            f"({type(optimizer).__name__}), not an optimizer: pass the optimizer there and the "
                            "scheduler as scheduler=: aiak.optimize(model, optimizer, loader, scheduler=scheduler)")
        if isinstance(optimizer, nn.Module):
            raise TypeError(f"{CALL}: the second argument must be the optimizer, got another model "
                            f"({type(optimizer).__name__})")
        raise TypeError(f"{CALL}: the second argument must be the optimizer (a torch.optim.Optimizer) or None, got "
                        f"{type(optimizer).__name__}")
    if loader is not None and _is_scheduler(loader):
        raise TypeError(f"{CALL}: the third argument (loader) is a learning-rate scheduler ({type(loader).__name__}), "
                        "not a loader: it would come back as the loader and never be bound to the step; pass it as "
                        "scheduler=: aiak.optimize(model, optimizer, loader, scheduler=scheduler) (loader=None when "
                        "there is none)")
    if optimizer is not None:
        _check_optimizer_owns(model, optimizer)
    if scheduler is not None:
        _check_scheduler(scheduler, optimizer)


def _is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is a learning-rate scheduler: torch's (``ReduceLROnPlateau`` included), or a framework's that
    steers an optimizer (an ``optimizer`` attribute with param groups, a ``step``) and yields no batches."""
    if isinstance(obj, LRScheduler):
        return True
    steered = getattr(obj, "optimizer", None)
    return (hasattr(steered, "param_groups") and callable(getattr(obj, "step", None))
            and not hasattr(obj, "__iter__"))


def _check_optimizer_owns(model: nn.Module, optimizer: Optimizer) -> None:
    held = [p for group in optimizer.param_groups for p in group["params"]]
    model_params = list(model.parameters())
    mine = {id(p) for p in model_params}
    if held and not any(id(p) in mine for p in held):
        raise ValueError(
            f"{CALL}: the optimizer ({type(optimizer).__name__}) holds {len(held)} parameter tensor(s), none of them "
            f"the model's ({type(model).__name__}, {len(model_params)}): it was built for another model, and "
            "training would update that one. Build it from this model's parameters "
            f"({type(optimizer).__name__}(model.parameters(), ...)), after any change that replaces them")
    if model_params and not any(p.requires_grad for p in model_params):
        warn_once("nothing-trains", f"aiak: no parameter of the model ({type(model).__name__}) has requires_grad=True: "
                  "nothing of it trains now. The strategy is applied anyway (a backbone unfrozen later trains with "
                  "it); if the model should train, unfreeze it before the first step")


def _check_scheduler(scheduler: Any, optimizer: Optional[Optimizer]) -> None:
    steered = getattr(scheduler, "optimizer", None)
    if steered is None:
        return  # a scheduler of a framework that keeps its optimizer elsewhere
    inner = getattr(steered, "optimizer", getattr(steered, "_optimizer", steered))  # a framework's wrapper
    if optimizer is None or (steered is not optimizer and inner is not optimizer):
        raise ValueError(f"{CALL}: the scheduler ({type(scheduler).__name__}) was built on another optimizer "
                         f"({type(steered).__name__}) than the one given "
                         f"({type(optimizer).__name__ if optimizer is not None else 'none'}): stepping it would "
                         "change that optimizer's learning rate. Build it on the optimizer passed here")


RETURNS = ("model", "optimizer", "loader")


def check_unpacking(scheduler_given: bool, depth: int = 2) -> None:
    """Raise a ``TypeError`` naming what ``optimize`` returns when the calling line (``depth`` frames up) unpacks its
    result into another number of names. Anything but a plain ``a, b, ... = aiak.optimize(...)`` is left alone."""
    returns = RETURNS + (("scheduler",) if scheduler_given else ())
    wanted = _unpacked_into(depth + 1)
    if wanted is None or wanted == len(returns):
        return
    names = ", ".join(returns)
    raise TypeError(f"aiak.optimize returns {len(returns)} objects, ({names}) (None where one was not given, "
                    f"so that every script unpacks it alike), but this line unpacks it into {wanted} names: write "
                    f"{', '.join(returns[:wanted] if wanted < len(returns) else returns)}"
                    f"{', _' * max(len(returns) - wanted, 0)} = aiak.optimize(...)")


def _unpacked_into(depth: int) -> Optional[int]:
    """The count of the ``UNPACK_SEQUENCE`` right after the call running in the frame ``depth`` up from here, if
    any."""
    try:
        frame = sys._getframe(depth)
    except ValueError:
        return None
    # f_lasti is the call's offset, or (3.11+) that of its last inline cache entry: the first real instruction
    # past it is what the call's result meets
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > frame.f_lasti and ins.opname not in ("CACHE", "EXTENDED_ARG", "NOP"):
            return ins.arg if ins.opname == "UNPACK_SEQUENCE" else None
    return None


def refuse_replaced_parameters(model: Any, optimizer: Optional[Optimizer]) -> None:
    """At ``optimizer``'s first step (once): if the model's parameters were replaced since ``optimize()`` (the
    optimizer holds parameters the model no longer has, and the model has parameters the optimizer never saw that
    are DTensors, or none it saw), raise one error saying what happened and what to do."""
    if optimizer is None or not isinstance(model, nn.Module) or not hasattr(optimizer, "register_step_pre_hook"):
        return
    given = {id(p) for g in optimizer.param_groups for p in g["params"]}

    def check(opt, args, kwargs):
        handle.remove()
        now = [p for p in model.parameters() if p.requires_grad]
        ids = {id(p) for p in now}
        stale = given - ids
        new = [p for p in now if id(p) not in given]
        if not (stale and new):
            return
        sharded = _dtensors(new)
        if sharded or len(new) == len(now):
            raise RuntimeError(
                f"aiak: {len(stale)} of the optimizer's parameters are no longer the model's: they were replaced after "
                f"aiak.optimize() ({'fully_shard or another DTensor sharding' if sharded else 'the model was rebuilt'}"
                "), so this optimizer would update tensors the model does not use and train nothing. Shard the model "
                "first: fully_shard, then build the optimizer on the sharded model, then aiak.optimize")

    handle = optimizer.register_step_pre_hook(check)


def _dtensors(params) -> list:
    """The DTensors among ``params`` (FSDP2's and tensor parallelism's parameters)."""
    return [p for p in params if is_dtensor(p)]

