"""Measured trials, the numerics gate, the decision record and the one tuning cache.

``optimize()`` runs the trials when the strategy says ``tune`` (on by default for ``"auto"``):
:mod:`aiak.tune.trials`. :func:`explain` is what ``aiak explain`` prints. Importing this package needs only
torch and touches no CUDA.
"""
from __future__ import annotations

from typing import Any

from aiak.tune.cache import TuneCache
from aiak.tune.decision import Decision, last_decision

__all__ = ["Decision", "TuneCache", "explain", "last_decision"]


def explain(model, optimizer=None, loader=None, *, strategy: Any = "auto", tune: bool = False, device: Any = None
            ) -> Decision:
    """What ``strategy`` would apply to these objects, knob by knob, and why.

    ``tune=False``: the rules' pick only; nothing is measured and the objects are not changed.
    ``tune=True``: ``optimize()`` runs on the objects (trials included) and its record is returned.
    """
    from aiak.strategy.select import resolve_strategy
    from aiak.tune import decision

    if tune:
        import aiak

        aiak.optimize(model, optimizer, loader, strategy=strategy, device=device)
        return decision.last_decision()
    selection = resolve_strategy(strategy, model, optimizer, loader, device=device)
    record = decision.build(selection, selection.strategy, None, None)
    if selection.strategy.tune:
        record.tuning = "not measured here (aiak explain --tune measures the candidates)"
    return record
