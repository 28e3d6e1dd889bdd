"""A script's own ``torch.amp.GradScaler`` beside aiak's fp16 precision: one loss scaler, never two.

torchvision's and timm's reference scripts run ``--amp`` as ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)`` before clipping, ``scaler.step(optimizer)``, ``scaler.update()``. aiak's
parameters stay fp32 under O1/O2, so that scaler unscales and steps them as it would without aiak. Two
scalers must not multiply, though (aiak's 65536 times the script's 65536 overflows fp16 at once, and each
would back off without the other knowing): so the first time an enabled ``GradScaler`` scales a loss in this
process, aiak's own fp16 loss scaling stands aside (its scale becomes 1 inside the graph, with one warning),
and the script's scaler is the only one, with its own dynamic scale and overflow skips.

``GradScaler.unscale_`` divides the gradients once per ``optimizer.step()`` call; under aiak's
``grad_accumulation`` those are partial sums until the window's last call, which would be divided again at
every micro-step, so that combination is refused with what to change.

Only ``torch.amp.GradScaler.scale`` and ``unscale_`` are wrapped (``torch.cuda.amp.GradScaler`` is a subclass),
when a strategy first asks for fp16 loss scaling; every call runs torch's own method.
"""
from __future__ import annotations

import functools

import torch

from aiak.amp.warn import warn_once

_installed = False
_seen = False


def active() -> bool:
    """An enabled ``torch.amp.GradScaler`` has scaled a loss in this process."""
    return _seen


def watch() -> None:
    """Wrap ``GradScaler.scale`` / ``unscale_`` (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    cls = torch.amp.GradScaler
    cls.scale = _noting_scale(cls.scale)
    cls.unscale_ = _refusing_unscale(cls.unscale_)


def _noting_scale(original):
    @functools.wraps(original)
    def scale(self, outputs):
        global _seen
        if self.is_enabled() and not _seen:
            _seen = True
            warn_once("script-grad-scaler", "aiak: the script's torch.amp.GradScaler scales the loss, so aiak's own "
                      "fp16 loss scaling stands aside (two scalers would multiply): the script's scaler does the "
                      "scaling, the overflow skips and the unscaling before clipping")
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
