"""A script's own ``torch.amp.GradScaler`` beside aiak's fp16 precision: one loss scaler, never two.

torchvision's and timm's reference scripts run ``--amp`` as ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)`` before clipping, ``scaler.step(optimizer)``, ``scaler.update()``. aiak's
parameters stay fp32 under O1/O2, so that scaler unscales and steps them as it would without aiak. Two
scalers must not multiply, though (aiak's 65536 times the script's 65536 overflows fp16 at once, and each
would back off without the other knowing): so when an enabled ``GradScaler`` scales a loss computed from an
aiak model's outputs, that model's own loss scaler stands aside for good (its scale is 1 inside the graph,
from this very backward on; one warning), and the script's scaler is the only one, with its own dynamic scale
and overflow skips. Which models a loss comes from is read from its autograd graph: the walk from the loss
stops at the gradient-scaling nodes of aiak's half-precision regions (:mod:`aiak.amp.half_compute`), which
sit on the models' outputs, so it does not enter the models. Other aiak models in the process keep their
scaling.

``GradScaler.unscale_`` divides the gradients once per ``optimizer.step()`` call; under aiak's
``grad_accumulation`` those are partial sums until the window's last call, which would be divided again at
every micro-step, so that combination is refused with what to change.

Only ``torch.amp.GradScaler.scale`` and ``unscale_`` are wrapped (``torch.cuda.amp.GradScaler`` is a subclass),
when a strategy first asks for fp16 loss scaling; every call runs torch's own method.
"""
from __future__ import annotations

import functools
from typing import List

import torch

from aiak.amp.half_compute import scaling_node_scaler
from aiak.util.warn import warn_once

_installed = False


def watch() -> None:
    """Wrap ``GradScaler.scale`` / ``unscale_`` (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    cls = torch.amp.GradScaler
    cls.scale = _noting_scale(cls.scale)
    cls.unscale_ = _refusing_unscale(cls.unscale_)


def scalers_under(outputs) -> List:
    """The loss scalers of the aiak regions whose outputs ``outputs`` (a tensor or an iterable of them) were
    computed from: found on the regions' gradient-scaling nodes, where the walk stops."""
    found, seen = [], set()
    stack = [t.grad_fn for t in ([outputs] if torch.is_tensor(outputs) else outputs)
             if torch.is_tensor(t) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        scaler = scaling_node_scaler(node)
        if scaler is not None:
            if all(scaler is not f for f in found):
                found.append(scaler)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _noting_scale(original):
    @functools.wraps(original)
    def scale(self, outputs):
        if self.is_enabled():
            for scaler in scalers_under(outputs):
                if not scaler.stood_aside:
                    scaler.stood_aside = True
                    warn_once("script-grad-scaler", "aiak: the script's torch.amp.GradScaler scales the loss, so "
                              "aiak's own fp16 loss scaling stands aside for this model (two scalers would "
                              "multiply): the script's scaler does the scaling, the overflow skips and the "
                              "unscaling before clipping")
        return original(self, outputs)

    return scale


def _refusing_unscale(original):
    @functools.wraps(original)
    def unscale_(self, optimizer):
        inner = getattr(optimizer, "optimizer", getattr(optimizer, "_optimizer", optimizer))
        controller = getattr(optimizer, "_aiak_steps", None) or getattr(inner, "_aiak_steps", None)
        if self.is_enabled() and controller is not None and controller.active() and controller.accumulation > 1:
            raise RuntimeError(
                f"aiak: the script's torch.amp.GradScaler unscales the gradients at every optimizer.step() call, but "
                f"under aiak's grad_accumulation: {controller.accumulation} they are a partial sum until the "
                "window's last call, which it would divide again each time. Either accumulate in the script and set "
                "grad_accumulation: 1 in the strategy, or drop the script's GradScaler (aiak's precision with "
                "dtype fp16 scales the loss itself)")
        return original(self, optimizer)

    return unscale_
