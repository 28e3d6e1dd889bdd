"""A script's own ``torch.amp.GradScaler`` beside aiak's fp16 precision: one loss scaler, never two.

torchvision's and timm's reference scripts run ``--amp`` as ``scaler.scale(loss).backward()``,
``scaler.unscale_(optimizer)`` before clipping, ``scaler.step(optimizer)``, ``scaler.update()``. aiak's
parameters stay fp32 under O1/O2, so that scaler unscales and steps them as it would without aiak. Two
scalers must not multiply, though (aiak's 65536 times the script's 65536 overflows fp16 at once, and each
would back off without the other knowing): so when an enabled ``GradScaler`` scales a loss computed with an
aiak model's fp16 parameters, that model's own loss scaler stands aside for good (from this very backward on,
`aiak.amp.scaling.root_scaling` leaves a pass that reaches only stood-aside models unscaled; one warning), and the
script's scaler is the only one, with its own dynamic scale and overflow skips. Which models a loss comes from
is read from its autograd graph (the parameters it reaches), so a loss through two aiak models, ``B(A(x))``,
sets both aside. Other aiak models in the process keep their scaling.

``GradScaler.unscale_`` divides the gradients once per ``optimizer.step()`` call; under aiak's
``grad_accumulation`` those are partial sums until the window's last call, which would be divided again at
every micro-step, so that combination is refused with what to change.

Only ``torch.amp.GradScaler.scale`` and ``unscale_`` are wrapped (``torch.cuda.amp.GradScaler`` is a subclass),
when a strategy first asks for fp16 loss scaling (the ``grad-scaler`` patch of `aiak.runtime.patches`);
every call runs torch's own method.
"""
from __future__ import annotations

import functools

import torch

from aiak.amp.scaling.root_scaling import scalers_reached
from aiak.runtime import patches
from aiak.runtime.marks import marked
from aiak.util.warn import warn_once


def watch() -> None:
    """Wrap ``GradScaler.scale`` / ``unscale_`` (once per process)."""
    if patches.installed("grad-scaler"):
        return
    cls = torch.amp.GradScaler
    patches.replace("grad-scaler", cls, "scale", _noting_scale(cls.scale))
    patches.replace("grad-scaler", cls, "unscale_", _refusing_unscale(cls.unscale_))


def _noting_scale(original):
    @functools.wraps(original)
    def scale(self, outputs):
        if self.is_enabled():
            for scaler in scalers_reached(outputs):
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
        controller = marked(optimizer, "_aiak_steps") or marked(inner, "_aiak_steps")
        if self.is_enabled() and controller is not None and controller.active() and controller.accumulation > 1:
            raise RuntimeError(
                f"aiak: the script's torch.amp.GradScaler unscales the gradients at every optimizer.step() call, but "
                f"under aiak's grad_accumulation: {controller.accumulation} they are a partial sum until the "
                "window's last call, which it would divide again each time. Either accumulate in the script and set "
                "grad_accumulation: 1 in the strategy, or drop the script's GradScaler (aiak's precision with "
                "dtype fp16 scales the loss itself)")
        return original(self, optimizer)

    return unscale_
