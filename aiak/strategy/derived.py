"""Settings that follow from others and from the run: resolved once, before any phase applies the strategy.

A strategy holds what the user, a profile or the trials chose. A few settings follow from that choice together
with how many ranks train; `resolve_derived` sets them, and says why, so that the phases of
`aiak.apply.apply_strategy` apply the strategy as it is and derive nothing, and the decision record shows
each one with its reason (source ``derived``, `aiak.tune.decision`). The trials apply their candidates in
one process, where nothing is derived.

The rules, in order (each sees the settings the previous ones derived):

* gradients in the half dtype under O2: on several ranks, with ``comm.compression: none`` and a communication
  algorithm whose averages may travel in half (``half_gradients``), ``comm.compression`` becomes
  ``precision.dtype``, as apex's O2 did (its gradients were the half model's own); not under ``comm.engine:
  fsdp2``, whose gradients FSDP reduces in ``comm.fsdp.reduce_dtype``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, List, Optional, Tuple

from aiak.comm.algorithms import algorithm_class
from aiak.strategy.schema import Strategy


@dataclass(frozen=True)
class Derived:
    path: str      # the knob's key path, ``section.key``
    value: Any     # what it was set to
    reason: str    # why, for the decision record


def resolve_derived(s: Strategy, world_size: int) -> Tuple[Strategy, List[Derived]]:
    """``s`` with every derived setting of a run on ``world_size`` ranks, and those settings with their reasons."""
    derived: List[Derived] = []
    for rule in RULES:
        setting = rule(s, world_size)
        if setting is not None:
            s = _with(s, setting)
            derived.append(setting)
    return s, derived


def o2_gradients_in_half(s: Strategy, world_size: int) -> Optional[Derived]:
    """Under O2 on several ranks, DDP's gradient averages travel in the half dtype unless compression is chosen
    (under ``comm.engine: fsdp2`` FSDP reduces them in ``comm.fsdp.reduce_dtype``: nothing to derive)."""
    if not (s.precision.level == "O2" and s.comm.compression == "none" and world_size > 1
            and s.comm.engine == "ddp" and algorithm_class(s.comm.algorithm).half_gradients):
        return None
    return Derived("comm.compression", s.precision.dtype,
                   f"precision O2 on {world_size} ranks with comm.algorithm {s.comm.algorithm}: gradients travel in "
                   f"{s.precision.dtype}, as apex's O2 did")


RULES = (o2_gradients_in_half,)


def _with(s: Strategy, setting: Derived) -> Strategy:
    """``s`` with the key ``setting.path`` (``section.key``) set to ``setting.value``."""
    section, key = setting.path.split(".")
    return replace(s, **{section: replace(getattr(s, section), **{key: setting.value})})
