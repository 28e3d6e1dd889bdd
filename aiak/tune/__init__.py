"""Measured trials, the numerics gate and the decision record.

``optimize()`` runs the trials when the strategy says ``tune`` (on by default for ``"auto"``):
`aiak.tune.trials`; `aiak.tune.decision` keeps the record that ``aiak explain`` prints. Importing this
package needs only torch and touches no CUDA.
"""
from aiak.tune.decision import Decision, last_decision

__all__ = ["Decision", "last_decision"]
