"""Re-point a learning-rate scheduler from the user's optimizer to the one ``optimize()`` swapped in.

A LAMB/LARS swap splits each user param group into "adapted + decayed" and "excluded" groups, so a scheduler
built on the user's optimizer has per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``, ``min_lrs``,
...) of the old length. Each new group comes from exactly one user group (found through its parameters);
every per-group list is expanded along that mapping, so each new group follows its source group's schedule.

A learning rate set in the strategy (``optimizer: {name: lars, lr: 0.7}``) takes the place of the user's base
rate (the ``lr`` the user's optimizer was built with, which the scheduler calls ``base_lrs``), and the user's
schedule goes on around it: every rate the scheduler derives from that base (``base_lrs``, ``_last_lr``, the
groups' ``initial_lr``) is scaled by ``strategy lr / base``, as if the scheduler had been built on the new
optimizer. Before, the group's rate was overwritten with the scheduler's last rate, so LARS ran at the user's
SGD rate while the decision record said 0.7. ``OneCycleLR`` takes its rates from its own ``max_lr``, not from
the optimizer (built on the new optimizer it would ignore the strategy's rate too): it keeps its schedule, and
a warning says that the strategy's rate is not used and where to set it.
"""
from __future__ import annotations

from typing import List

import torch

from aiak.amp.warn import warn_once


def source_groups(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> List[int]:
    """For each group of ``new``, the index of the ``old`` group its parameters came from."""
    owner = {id(p): i for i, g in enumerate(old.param_groups) for p in g["params"]}
    mapping = []
    for g in new.param_groups:
        sources = {owner.get(id(p)) for p in g["params"]}
        if len(sources) != 1 or None in sources:
            raise ValueError("aiak: cannot re-point the scheduler: a group of the new optimizer mixes parameters "
                             "of several (or no) groups of the original optimizer")
        mapping.append(sources.pop())
    return mapping


def rebind_scheduler(scheduler, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` drive ``new`` as it drove ``old``; lists with one entry per old group are expanded."""
    if old is new or getattr(scheduler, "optimizer", None) is not old:
        return
    mapping = source_groups(old, new)
    n_old = len(old.param_groups)
    for name, value in list(vars(scheduler).items()):
        if name != "optimizer" and isinstance(value, (list, tuple)) and len(value) == n_old:
            setattr(scheduler, name, type(value)(value[i] for i in mapping))
    scheduler.optimizer = new
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        one_cycle = isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
        for i, (group, j) in enumerate(zip(new.param_groups, mapping)):
            if group["lr"] != old.param_groups[j]["lr"] and scheduler.base_lrs[i]:  # the strategy set this rate
                if one_cycle:
                    warn_once("one_cycle_lr", f"aiak: optimizer.lr {group['lr']:g} from the strategy is not used: "
                              "OneCycleLR sets the rates from its own max_lr (give OneCycleLR the max_lr you want)")
                else:
                    _scale_schedule(scheduler, i, group, group["lr"] / scheduler.base_lrs[i])
            group["lr"] = scheduler.get_last_lr()[i]
        _track_step_called(new)


def _scale_schedule(scheduler, index: int, group: dict, ratio: float) -> None:
    """Scale the rates of group ``index`` that ``scheduler`` derives its schedule from by ``ratio``."""
    for name in ("base_lrs", "_last_lr"):
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) > index:
            values[index] = values[index] * ratio
    if isinstance(group.get("initial_lr"), (int, float)):
        group["initial_lr"] = group["initial_lr"] * ratio


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """What ``LRScheduler.__init__`` does to its optimizer, so its "step order" checks keep working."""
    inner = optimizer.step
    if getattr(inner, "_wrapped_by_lr_sched", False):
        return

    def step(*args, **kwargs):
        optimizer._opt_called = True
        return inner(*args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step
