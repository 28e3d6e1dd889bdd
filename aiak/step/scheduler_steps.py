"""A learning-rate scheduler advances once per real optimizer step, however the script steps it.

With ``grad_accumulation: N`` the script's loop still calls ``scheduler.step()`` after every ``optimizer.step()``,
and N-1 of those are micro-steps that update nothing. A scheduler stepped on each would run its schedule N times
too fast. So the ``step`` of every scheduler class (``torch.optim.lr_scheduler.LRScheduler`` and the subclasses
that define their own ``step``, plus the class of a scheduler given to ``optimize(scheduler=...)``) is wrapped,
once per class, by a gate that asks one question: *since this scheduler last stepped, were there calls to its
optimizer's ``step()``, and none of them a real step?* If so the call is an accumulation micro-step's and does
nothing; otherwise the scheduler's own ``step`` runs. The gate holds no state on the scheduler (a
``WeakKeyDictionary`` beside it): the scheduler keeps the user's class and ``__dict__``, so ``isinstance``,
``state_dict()`` and ``torch.save(scheduler)`` are unchanged, and a scheduler built on the returned optimizer
after ``optimize()`` is gated like one given to it.

What the gate lets through is what plain PyTorch does: the steps a scheduler takes while it is built (no
optimizer call in between), a per-epoch scheduler stepped after a whole epoch, a step after a real step or after
one skipped for inf/NaN gradients (plain PyTorch's ``GradScaler`` loop steps the scheduler then too). Schedulers
of an optimizer aiak does not step pass straight through. A scheduler class defined after the first
``optimize()`` with accumulation is not wrapped (classes are defined at import time, before it in every
script we know of). The wrapped ``step`` methods are the ``schedulers`` patch of `aiak.runtime.patches`.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Tuple

import torch

from aiak.runtime import patches
from aiak.runtime.marks import marked

# scheduler -> (the controller it was counted against, its optimizer's step() calls and real steps then)
_seen: "weakref.WeakKeyDictionary[Any, Tuple[Any, int, int]]" = weakref.WeakKeyDictionary()


def gate_scheduler_classes(*extra: type) -> None:
    """Wrap ``step`` of every ``LRScheduler`` class defining one (and of ``extra`` classes' defining class);
    idempotent."""
    classes = _with_subclasses(torch.optim.lr_scheduler.LRScheduler)
    for cls in extra:
        classes.append(next((k for k in cls.__mro__ if "step" in vars(k)), cls))
    for cls in classes:
        step = vars(cls).get("step")
        if step is not None and not patches.is_replacement(step):
            patches.replace("schedulers", cls, "step", _gated(step))


def follow(scheduler: Any, controller: Any) -> None:
    """Count ``scheduler``'s steps against ``controller`` from now on (a scheduler given to ``optimize()``)."""
    gate_scheduler_classes(type(scheduler))
    _seen[scheduler] = (controller, controller.step_calls, controller.step_events)


def rebase(controller: Any) -> None:
    """``controller``'s counters were restored from a checkpoint: its schedulers count from here."""
    for scheduler, (owner, _, _) in list(_seen.items()):
        if owner is controller:
            _seen[scheduler] = (controller, controller.step_calls, controller.step_events)


def _should_step(scheduler: Any) -> bool:
    optimizer = getattr(scheduler, "optimizer", None)
    controller = marked(optimizer, "_aiak_steps")
    if controller is None or not controller.active():
        return True
    owner, calls, events = _seen.get(scheduler, (None, -1, -1))
    if owner is controller:
        micro_steps_only = controller.step_calls != calls and controller.step_events == events
    else:  # first seen: one being built (its first step sets the initial rates), or built before optimize()
        building = getattr(scheduler, "_step_count", None) == 0
        micro_steps_only = not building and controller.micro_step != 0
    _seen[scheduler] = (controller, controller.step_calls, controller.step_events)
    return not micro_steps_only


def _gated(step):
    @functools.wraps(step)
    def gated_step(scheduler, *args, **kwargs):
        if not _should_step(scheduler):
            return None
        return step(scheduler, *args, **kwargs)

    return gated_step


def _with_subclasses(cls: type) -> list:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _with_subclasses(sub)
    return out
