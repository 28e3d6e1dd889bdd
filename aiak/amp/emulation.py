"""Precisions a device only emulates: warn once per process and knob, with the measured cost and the way out.

Nothing fails when fp16 runs on a CPU: it is just very slow, which a user would only find out from a
profiler. So whenever a precision is known to be emulated on the device, ``apply_precision`` warns once
per process and kind (``warnings.warn`` plus the ``aiak`` logger), naming the cost and what to use:

* fp16 (O1 or O2) on a CPU: most CPU kernels have no fp16 arithmetic; use bf16 where the CPU has
  AVX512-BF16 / AMX-BF16, else fp32 (O0);
* bf16 on a CPU without avx512_bf16 / amx_bf16: emulated; use fp32 (O0);
* bf16 on CUDA below compute capability 8.0: no bf16 tensor cores; use fp16 with loss scaling.
* fp8 (``precision.fp8``) without fp8 tensor cores (a CPU, CUDA below 8.9): torchao emulates it; and with them
  but without ``torch.compile``, where torchao's float8 is slower than bf16.

The costs quoted come from ``benchmarks/precision_cpu.py --rounds 15`` on this project's 2-core AMD EPYC
test machine (avx512_bf16, no AMX, no avx512_fp16), idle, 2026-12-01: the median of the per-round ratio to
fp32 (min-max over rounds). O2 fp16 / fp32 = 27.4x (22.5-29.8) for resnet18 (64x64 images, batch 8) and
6.6x (4.7-8.7) for the demo CNN (width 16, 32x32, batch 32); with oneDNN capped at AVX2 (no bf16
instructions), O2 bf16 / fp32 = 15.3x (14.7-17.6) for resnet18 and 6.6x (5.1-8.9) for the demo CNN. On GPUs
below sm80 the bf16 cost is not measured here. fp8 emulated by torchao 0.18, same machine, 2026-12-05, against O2
bf16 on a transformer-shaped MLP (``--models mlp``, 15 rounds): tensorwise 5.34x (4.00-7.02), rowwise 5.40x
(4.08-6.63).
"""
from __future__ import annotations

from typing import FrozenSet, Optional, Tuple

import torch

from aiak.util.machine import cpu, devices
from aiak.util.warn import warn_once

FP16_CPU_COST = ("measured ~27x slower than fp32 per training step of torchvision's resnet18 and ~7x for the demo "
                 "CNN on a 2-core AMD EPYC (`python benchmarks/precision_cpu.py`)")
FP8_EMULATED_COST = ("measured ~5.4x slower than O2 bf16 per training step of a transformer-shaped MLP on a 2-core "
                     "AMD EPYC (`python benchmarks/precision_cpu.py --models mlp --baseline 'O2 bf16' --candidates "
                     "'O2 bf16,fp8 tensorwise,fp8 rowwise'`)")
BF16_EMULATED_CPU_COST = ("measured ~15x slower than fp32 for resnet18 on that machine with oneDNN restricted to "
                          "AVX2 (`python benchmarks/precision_cpu.py --isa-cap AVX2`)")


def emulation_warning(dtype: str, device: torch.device, *, cpu_flags: Optional[FrozenSet[str]] = None,
                      capability: Optional[Tuple[int, int]] = None) -> Optional[Tuple[str, str]]:
    """``(key, message)`` if ``dtype`` ("fp16" / "bf16") is emulated on ``device``, else None.

    ``cpu_flags`` and ``capability`` default to the probes of this machine (`aiak.util.machine.cpu`,
    `aiak.util.machine.devices`); passing them describes another machine. ``key`` names the knob and device kind,
    for warning once.
    """
    if device.type == "cpu":
        flags = cpu.cpu_features() if cpu_flags is None else cpu_flags
        native_bf16 = sorted(flags & cpu.NATIVE_BF16_CPU_FLAGS)
        if dtype == "fp16":
            if native_bf16:
                instead = f"use precision.dtype: bf16 instead (this CPU has {'/'.join(native_bf16)})"
            else:
                instead = ("use precision.level: O0 (fp32) instead (this CPU has no bf16 hardware either: no "
                           "avx512_bf16 / amx_bf16)")
            native_fp16 = sorted(flags & cpu.NATIVE_FP16_CPU_FLAGS)
            unhelpful = sorted(flags & cpu.FP16_FLAGS_THAT_DO_NOT_HELP)
            caveat = (f" This CPU reports {'/'.join(native_fp16)}, which oneDNN can use; the cost there was not "
                      "measured, time it with benchmarks/precision_cpu.py." if native_fp16
                      else f" This CPU's {'/'.join(unhelpful)} does not make it fast: measured 55x fp32's step on "
                           "DemoNet, 94x on ResNet-18, 1.6x on an MLP." if unhelpful else "")
            return "fp16-on-cpu", (f"aiak: precision.dtype fp16 on CPU is emulated (most CPU kernels have no fp16 "
                                   f"arithmetic): {FP16_CPU_COST}; {instead}.{caveat}")
        if dtype == "bf16" and not native_bf16:
            return "bf16-on-cpu", ("aiak: precision.dtype bf16 on this CPU is emulated (no avx512_bf16 / amx_bf16 in "
                                   f"/proc/cpuinfo): {BF16_EMULATED_CPU_COST}; use precision.level: O0 (fp32) "
                                   "instead.")
        return None
    if device.type == "cuda" and dtype == "bf16":
        cap = devices.cuda_capability(device) if capability is None else capability
        if cap is not None and cap < (8, 0):
            return "bf16-on-cuda", (f"aiak: precision.dtype bf16 on {device} (compute capability {cap[0]}.{cap[1]}) "
                                    "is emulated: bf16 tensor cores need compute capability 8.0 (Ampere) or newer "
                                    "(cost not measured here); use precision.dtype: fp16 with loss_scale: dynamic "
                                    "instead.")
    return None


def native_fp8(device: torch.device, capability: Optional[Tuple[int, int]] = None) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA compute capability 8.9 and newer); ``capability`` describes
    another GPU."""
    if device.type != "cuda":
        return False
    cap = devices.cuda_capability(device) if capability is None else capability
    return cap is not None and tuple(cap) >= devices.CUDA_NATIVE_FP8


def fp8_warning(device: torch.device, compiled: bool, *,
                capability: Optional[Tuple[int, int]] = None) -> Optional[Tuple[str, str]]:
    """``(key, message)`` when ``precision.fp8`` will not be fast on ``device``: emulated without fp8 tensor cores
    (a CPU, CUDA below compute capability 8.9), or native but without ``torch.compile`` (torchao's float8 casts
    run as separate eager kernels, slower than bf16); else None."""
    if native_fp8(device, capability):
        if compiled:
            return None
        return "fp8-without-compile", ("aiak: precision.fp8 without torch.compile: torchao's float8 casts and "
                                       "scales run as separate eager kernels, slower than bf16 (torchao's "
                                       "float8 training is built to be compiled); set compile: true.")
    if device.type == "cuda":
        cap = devices.cuda_capability(device) if capability is None else capability
        where = f"{device} (compute capability {cap[0]}.{cap[1]})" if cap is not None else str(device)
    else:
        where = device.type
    return "fp8-emulated", (f"aiak: precision.fp8 on {where} is emulated by torchao: fp8 tensor cores need CUDA "
                            f"compute capability 8.9 or newer (Ada, Hopper, Blackwell); {FP8_EMULATED_COST}. Use "
                            "precision.fp8: off here, and fp8 on such a GPU.")


def warn_if_fp8_is_slow(device: torch.device, compiled: bool) -> None:
    """Warn (once per process and key) when ``precision.fp8`` will not be fast on ``device``."""
    found = fp8_warning(device, compiled)
    if found is not None:
        warn_once(*found)


def warn_if_emulated(dtype: str, device: torch.device) -> Optional[str]:
    """Warn (once per process and key) if ``dtype`` is emulated on ``device``; returns a note for the summary."""
    found = emulation_warning(dtype, device)
    if found is None:
        return None
    warn_once(*found)
    return f"{dtype} emulated on {device.type}: slow (warned)"
