"""Optimizer wrappers of the frameworks, seen through: aiak patches the real optimizer inside.

Accelerate's ``AcceleratedOptimizer`` (``accelerator.prepare(optimizer)``) keeps the user's optimizer as
``.optimizer`` and Lightning's ``LightningOptimizer`` (``self.optimizers()``) as ``._optimizer``; both forward
``step``/``zero_grad``/``param_groups`` to it. ``aiak.optimize`` given such a wrapper works on the optimizer
inside (the step controller patches that one, so the wrapper's own ``step`` logic, Accelerate skipping
steps while it accumulates say, still runs around aiak's) and returns the wrapper. Only ``sys.modules`` is
consulted: no framework is imported here.
"""
from __future__ import annotations

import sys
from typing import Any, List, Tuple

# (module, class, attribute holding the wrapped optimizer)
_WRAPPERS = (
    ("accelerate.optimizer", "AcceleratedOptimizer", "optimizer"),
    ("pytorch_lightning.core.optimizer", "LightningOptimizer", "_optimizer"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "_optimizer"),
)


def _inner_attribute(optimizer: Any):
    for module_name, class_name, attribute in _WRAPPERS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(optimizer, cls):
            return attribute
    return None


def unwrap_optimizer(optimizer: Any) -> Tuple[Any, List[Tuple[Any, str]]]:
    """``(the optimizer inside every framework wrapper, [(wrapper, attribute), ...] outermost first)``."""
    chain = []
    attribute = _inner_attribute(optimizer)
    while attribute is not None:
        chain.append((optimizer, attribute))
        optimizer = getattr(optimizer, attribute)
        attribute = _inner_attribute(optimizer)
    return optimizer, chain


def rewrap_optimizer(chain: List[Tuple[Any, str]], inner: Any) -> Any:
    """The outermost wrapper again, now around ``inner`` (a new optimizer when the strategy swapped it for LAMB /
    LARS); ``inner`` itself when there was no wrapper."""
    if not chain:
        return inner
    wrapper, attribute = chain[-1]
    if getattr(wrapper, attribute) is not inner:
        setattr(wrapper, attribute, inner)
    return chain[0][0]
