"""Re-point a learning-rate scheduler from the user's optimizer to the one ``optimize()`` swapped in.

A LAMB/LARS swap splits each user param group into "adapted + decayed" and "excluded" groups, so a scheduler
built on the user's optimizer has per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``, ``min_lrs``,
...) of the old length. Each new group comes from exactly one user group (found through its parameters);
every per-group list is expanded along that mapping, so each new group follows its source group's schedule.
"""
from __future__ import annotations

from typing import List

import torch


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
        for group, lr in zip(new.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        _track_step_called(new)


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
