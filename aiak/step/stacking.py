"""Which framework around aiak already does gradient accumulation, and how many batches per step.

Lightning (``Trainer(accumulate_grad_batches=N)``), Accelerate (``Accelerator(gradient_accumulation_steps=N)``,
whose ``backward`` divides the loss by N and whose optimizer wrapper steps on every N-th call) and the Hugging
Face ``Trainer`` (``gradient_accumulation_steps``, run through Accelerate) each divide the loss and skip
optimizer steps themselves. aiak's ``grad_accumulation`` on top would multiply the window (measured once:
6 aiak steps in 12 Trainer steps, on partial gradients); the step controller asks here once, before its first
scaled backward, and turns its own accumulation off when a framework's is on.

Only modules already imported are looked at (``sys.modules``): this never imports a framework.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

_LIGHTNING_MODULES = ("pytorch_lightning", "lightning.pytorch")


def framework_accumulation(model: Any = None) -> Optional[Tuple[str, Optional[int]]]:
    """``(what to call the setting, N)`` for a framework accumulating N > 1 batches per step (N None where it
    cannot be read), else None. Call it during a backward or a step (the Trainer's signal is only there then).

    ``model`` (the model given to ``aiak.optimize``) identifies a Lightning module attached to a Trainer;
    Accelerate's setting is process-wide (its ``GradientState`` is a singleton the Trainer shares).
    """
    found = _lightning(model)
    return found if found is not None else _accelerate()


def _lightning(model: Any) -> Optional[Tuple[str, Optional[int]]]:
    for name in _LIGHTNING_MODULES:
        pl = sys.modules.get(name)
        module_cls = getattr(pl, "LightningModule", None)
        if module_cls is not None and isinstance(model, module_cls):
            trainer = getattr(model, "_trainer", None)
            steps = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
            if steps > 1:
                return "Lightning's Trainer(accumulate_grad_batches)", steps
    return None


def _accelerate() -> Optional[Tuple[str, Optional[int]]]:
    """Accelerate's ``GradientState``: ``num_steps > 1`` (``Accelerator(gradient_accumulation_steps=N)``), or
    ``sync_gradients`` off during a backward: the Trainer keeps Accelerate's ``num_steps`` at 1 and accumulates
    itself, turning ``sync_gradients`` off for every micro-batch but the last of its window."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    if gradient_state is None or not gradient_state._shared_state:
        return None
    current = gradient_state()
    steps = int(current.num_steps or 1)
    if steps > 1:
        return "Accelerate's Accelerator(gradient_accumulation_steps)", steps
    if not current.sync_gradients:
        where = ("the Trainer's TrainingArguments(gradient_accumulation_steps)" if "transformers.trainer" in sys.modules
                 else "Accelerate (its sync_gradients is off)")
        return where, None
    return None
