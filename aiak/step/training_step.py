"""The step every user's loop runs, written once: forward and loss, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``.

aiak never asks for a different loop, so whatever it times or checks on the user's behalf (``aiak demo``'s
two runs, ``aiak bench``'s contenders, the auto-selector's trials) runs this one, each with its own loss and
batch delivery. ``observe`` is called at the step's phases (``"forward"``, ``"backward"``, ``"optimizer"``):
``aiak bench`` samples memory there, the trials read the gradients after the backward.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

LossOf = Callable[[nn.Module, Any], torch.Tensor]


def training_step(model: nn.Module, optimizer: Any, batch: Any, loss_of: LossOf,
                  observe: Optional[Callable[[str], None]] = None) -> torch.Tensor:
    """One step of ``model`` on ``batch``; returns the loss (still attached to its graph)."""
    loss = loss_of(model, batch)
    if observe is not None:
        observe("forward")
    loss.backward()
    if observe is not None:
        observe("backward")
    optimizer.step()
    optimizer.zero_grad()
    if observe is not None:
        observe("optimizer")
    return loss
