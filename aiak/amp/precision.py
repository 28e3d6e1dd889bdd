"""Mixed precision O1 / O2 with apex's semantics, without apex, and without touching the user's parameters.

O1 runs each forward under ``torch.autocast``; O2 (apex's "almost fp16") computes every module except
normalization layers in the half dtype. Under both, the model's parameters stay the user's fp32 tensors: a
forward computes with half copies made in the autograd graph (`aiak.amp.half_compute`), so gradients
arrive on the fp32 parameters in fp32, and an EMA copy, an in-place edit of a weight, a parameter group added
later, a checkpoint loaded in any order and DDP all see plain fp32 parameters. Floating inputs are cast to
the half dtype on the way into the model and outputs come back as fp32.

fp16 uses a `aiak.amp.scaling.loss_scaler.LossScaler` (Micikevicius et al., section 3.2) applied inside the
graph, at the model's outputs and undone where gradients leave it; bf16 has fp32's exponent range and needs
none. A script's own ``torch.amp.GradScaler`` takes the place of aiak's (`aiak.amp.scaling.script_scaler`). A
precision the device only emulates (fp16 on a CPU, say) warns once, with its measured cost
(`aiak.amp.emulation`).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from aiak.amp.scaling import script_scaler
from aiak.amp.config import Precision
from aiak.amp.emulation import warn_if_emulated, warn_if_fp8_is_slow
from aiak.amp.fp8 import Fp8Plan, apply_fp8
from aiak.amp.fp32_modules import keep_declared
from aiak.amp.half_compute import HalfCompute
from aiak.amp.scaling.loss_scaler import LossScaler
from aiak.util.machine.devices import model_device
from aiak.util.warn import warn_once

logger = logging.getLogger("aiak")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class PrecisionState:
    """What `apply_precision` did: the config, the loss scaler (fp16) and the model's compute hooks."""

    def __init__(self, config: Precision, scaler: Optional[LossScaler], compute: Optional[HalfCompute] = None,
                 hooked: int = 0, emulated: Optional[str] = None, fp8: Optional[Fp8Plan] = None):
        self.config = config
        self.scaler = scaler
        self.compute = compute
        self.hooked = hooked          # modules that open a half-precision region when called
        self.emulated = emulated      # a note when the device only emulates the dtype (it was warned about)
        self.fp8 = fp8                # which linear layers compute in fp8, and why the others do not

    def describe(self) -> str:
        c = self.config
        if c.level == "O0":
            parts = ["O0 (fp32)"]
        else:
            what = "autocast" if c.level == "O1" else "half compute copies of the fp32 parameters"
            parts = [f"{c.level} {c.dtype}: {what} in {self.hooked} module(s)"]
            parts.append(repr(self.scaler) if self.scaler else "no loss scaling")
            if self.emulated:
                parts.append(self.emulated)
        if self.fp8 is not None:
            parts.append(self.fp8.describe())
        return ", ".join(parts)


def make_scaler(config: Precision) -> Optional[LossScaler]:
    if config.level == "O0" or config.loss_scale == "none":
        return None
    if config.dtype == "bf16":
        if config.loss_scale != "dynamic":
            logger.info("aiak: precision.loss_scale=%s ignored: bf16 has fp32's exponent range and needs no "
                        "loss scaling", config.loss_scale)
        return None
    if config.loss_scale == "dynamic":
        return LossScaler(dynamic=True)
    return LossScaler(init_scale=float(config.loss_scale), dynamic=False)


def apply_precision(model: nn.Module, config: Precision, device_type: str, *,
                    device: Optional[torch.device] = None, scaled: bool = True,
                    compiled: bool = False) -> PrecisionState:
    """Make ``model`` (a bare model, or the module a DDP wraps) compute in O1/O2, and its eligible linear layers
    in fp8 when ``precision.fp8`` names a recipe; its parameters are untouched.

    ``scaled``: fp16 loss scaling is wanted (it needs a step controller to skip overflowing steps and adjust the
    scale, so `aiak.apply.apply_strategy` passes False without an optimizer). ``device`` (default: where the
    parameters are) only tells whether the device computes the half dtype (and fp8) natively. ``compiled``: the
    model will run under ``torch.compile`` (torchao's fp8 is slower than bf16 without it).
    """
    if model is None:
        return PrecisionState(config, None)
    state = _apply_levels(model, config, device_type, device, scaled)
    if config.fp8 != "off":
        where = model_device(model, device)
        state.fp8 = apply_fp8(model, config.fp8, config.fp8_skip, where)
        warn_if_fp8_is_slow(where, compiled)
    return state


def _apply_levels(model: nn.Module, config: Precision, device_type: str, device: Optional[torch.device],
                  scaled: bool) -> PrecisionState:
    """O1 / O2 (nothing at O0)."""
    if config.level == "O0":
        return PrecisionState(config, None)
    dtype = DTYPES[config.dtype]
    scaler = make_scaler(config) if scaled else None
    if scaler is not None:
        script_scaler.watch()
    if config.keep_fp32:
        if config.level == "O2":
            keep_declared(model, config.keep_fp32)
        else:
            warn_once("keep-fp32-o1", "aiak: precision.keep_fp32 applies to O2; under O1 autocast chooses the "
                      "precision of each op (use level: O2 to keep modules in fp32)")
    emulated = warn_if_emulated(config.dtype, model_device(model, device))
    compute = HalfCompute(config.level, dtype, device_type, scaler)
    return PrecisionState(config, scaler, compute, compute.install(model), emulated)
