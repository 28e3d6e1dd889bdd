"""Make the Triton interpreter compute bf16 the way the GPU does, so the kernels' bf16 path runs on CPU.

Two faults of the Triton 3.8 interpreter (``triton/runtime/interpreter.py``, ``InterpreterBuilder``), both
found by :func:`find_faults` with a 16x16 probe kernel:

* ``create_dot``: the interpreter stores bf16 tensors as their uint16 bit patterns (numpy has no bf16) and
  passes those integers to ``np.matmul`` unchanged, so a bf16 ``tl.dot`` multiplies bit patterns, not
  numbers (the probe's result is ~1e10 off a result of magnitude ~10). Only 8-bit floats are decoded first.
* ``cast_impl`` (behind ``create_fp_trunc``): fp32 -> bf16 calls ``_convert_float`` without a rounding
  mode, which truncates; a compiled kernel rounds to nearest even (``tensor.to()`` defaults to RTNE).

The GPU's bf16 ``tl.dot`` multiplies the bf16 operands exactly and accumulates in fp32. :func:`patch`
replaces exactly these two steps, each only where :func:`find_faults` saw it go wrong: the dot decodes bf16
operands to fp32 first (exact, a bf16 is the upper half of an fp32) and then runs the interpreter's own
fp32 dot; the fp32 -> bf16 cast rounds to nearest even through torch. Everything else in the kernels
(loads, stores, masks, exp, reductions, atomics, every other cast) still runs in the unmodified interpreter.

Import this module only with ``TRITON_INTERPRET=1`` set (the probe kernel is decorated at import).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

__all__ = ["find_faults", "patch"]

_PROBE = 16


@triton.jit
def _probe_kernel(A, B, Dot, Cast, SIZE: tl.constexpr):
    rows = tl.arange(0, SIZE)
    tile = rows[:, None] * SIZE + rows[None, :]
    dot = tl.dot(tl.load(A + tile), tl.load(B + tile), input_precision="ieee")
    tl.store(Dot + tile, dot)
    tl.store(Cast + tile, dot.to(tl.bfloat16))


def find_faults() -> dict:
    """{"dot": max abs error of a bf16 tl.dot against torch (fp32 product of the same bf16 values, /scale),
    "cast": how many of 256 fp32 -> bf16 casts differ from torch's round-to-nearest-even}."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(_PROBE, _PROBE, generator=gen).bfloat16() for _ in range(2))
    dot = torch.empty(_PROBE, _PROBE)
    cast = torch.empty(_PROBE, _PROBE, dtype=torch.bfloat16)
    _probe_kernel[(1,)](a, b, dot, cast, SIZE=_PROBE)
    want = a.float() @ b.float()
    return {"dot": ((dot - want).abs().max() / want.abs().max()).item(),
            "cast": int((cast.view(torch.int16) != dot.bfloat16().view(torch.int16)).sum())}


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    rounded = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(torch.bfloat16)
    return rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(values))


def _exact_bf16_dot(original):
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (interpreter.TensorHandle(_bf16_bits_to_fp32(t.data), tl.float32) if t.dtype.scalar == tl.bfloat16
                else t for t in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)
    return create_dot


def _rounding_bf16_cast(original):
    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), tl.bfloat16)
        return original(self, src, dst_type)
    return cast_impl


def patch() -> dict:
    """Fix the faults :func:`find_faults` reports (in this process only); returns the probe before and after."""
    before = find_faults()
    builder = interpreter.InterpreterBuilder
    if before["dot"] > 1e-6:
        builder.create_dot = _exact_bf16_dot(builder.create_dot)
    if before["cast"]:
        builder.cast_impl = _rounding_bf16_cast(builder.cast_impl)
    return {"before": before, "after": find_faults()}
