"""Re-point a learning-rate scheduler from the user's optimizer to the one ``optimize()`` swapped in.

A LAMB/LARS swap splits each user param group into "adapted + decayed" and "excluded" groups, so a scheduler
built on the user's optimizer has per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``, ``min_lrs``,
...) of the old length. Each new group comes from exactly one user group (found through its parameters);
every per-group list is expanded along that mapping, so each new group follows its source group's schedule.
A scheduler of schedulers (``SequentialLR``, ``ChainedScheduler``) is re-pointed with the schedulers inside it.

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

from aiak.util.warn import warn_once


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


# The lists an LR scheduler keeps one entry per param group in (torch 2.14: LambdaLR/MultiplicativeLR
# ``lr_lambdas``, ReduceLROnPlateau ``min_lrs``, CyclicLR ``max_lrs`` and momenta). Others (SequentialLR's
# ``_milestones``, OneCycleLR's ``_schedule_phases``) are not per group, even when their length happens to match.
PER_GROUP_LISTS = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums")


def rebind_scheduler(scheduler, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` drive ``new`` as it drove ``old``; its per-group lists are expanded along the groups'
    mapping. A scheduler of schedulers (``SequentialLR``, ``ChainedScheduler``: torchvision's warm-up) is
    re-pointed with every scheduler inside it."""
    chain = list(getattr(scheduler, "_schedulers", ())) + [scheduler]
    if old is new or all(getattr(s, "optimizer", None) is not old for s in chain):
        return
    mapping = source_groups(old, new)
    ratios = _strategy_rates(chain, old, new, mapping)
    for s in chain:
        for name in PER_GROUP_LISTS:
            values = vars(s).get(name)
            if isinstance(values, (list, tuple)) and len(values) == len(old.param_groups):
                setattr(s, name, type(values)(values[j] for j in mapping))
        if getattr(s, "optimizer", None) is old:
            s.optimizer = new
        for i, ratio in enumerate(ratios):
            if ratio != 1.0 and not isinstance(s, torch.optim.lr_scheduler.OneCycleLR):
                for name in ("base_lrs", "_last_lr"):
                    values = getattr(s, name, None)
                    if isinstance(values, list) and len(values) > i:
                        values[i] = values[i] * ratio
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        for i, (group, ratio) in enumerate(zip(new.param_groups, ratios)):
            if isinstance(group.get("initial_lr"), (int, float)):
                group["initial_lr"] = group["initial_lr"] * ratio
            group["lr"] = scheduler.get_last_lr()[i]
        _track_step_called(new)


def _strategy_rates(chain, old, new, mapping) -> List[float]:
    """Per new group: ``strategy lr / the user's base lr`` where the strategy set the group's rate, else 1. The
    base is the first scheduler of ``chain`` that keeps ``base_lrs``; OneCycleLR keeps its own rates (a warning)."""
    base = next((s.base_lrs for s in chain if isinstance(getattr(s, "base_lrs", None), list)), None)
    ratios = []
    for i, (group, j) in enumerate(zip(new.param_groups, mapping)):
        ratio = 1.0
        if base is not None and group["lr"] != old.param_groups[j]["lr"] and base[j]:  # the strategy set this rate
            if any(isinstance(s, torch.optim.lr_scheduler.OneCycleLR) for s in chain):
                warn_once("one_cycle_lr", f"aiak: optimizer.lr {group['lr']:g} from the strategy is not used: "
                          "OneCycleLR sets the rates from its own max_lr (give OneCycleLR the max_lr you want)")
            else:
                ratio = group["lr"] / base[j]
        ratios.append(ratio)
    return ratios


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
