"""Hardware probes: what this CPU and a CUDA device do natively.

Small, cached and side-effect free. ``aiak.amp`` reads them to warn when a precision is emulated, and the
auto-selector matches profiles' ``match.cpu_features`` / ``match.cuda_capability`` against them. Importing
this module reads no file and never touches CUDA; :func:`cuda_capability` touches CUDA only when it is
given a CUDA device.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, FrozenSet, Optional, Tuple

import torch

CPUINFO = "/proc/cpuinfo"

# CPU flags (as /proc/cpuinfo spells them) under which oneDNN runs bf16 convolutions and matmuls in
# hardware: AVX512-BF16 (Cooper Lake, Zen 4 and later), AMX-BF16 (Sapphire Rapids and later), and
# FEAT_BF16 on aarch64 (its "Features" line says "bf16").
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Flags that give the CPU fp16 arithmetic (AVX512-FP16, AMX-FP16; aarch64 "fphp"/"asimdhp").
NATIVE_FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16", "fphp", "asimdhp"})


@functools.lru_cache(maxsize=None)
def cpu_features() -> FrozenSet[str]:
    """The flags of the first CPU listed in ``/proc/cpuinfo`` (Linux), e.g. ``{"avx512f", "avx512_bf16",
    "amx_bf16", "amx_tile", ...}``; an empty set on other systems or when the file cannot be read.

    x86 kernels list them on a ``flags`` line, aarch64 kernels on a ``Features`` line.
    """
    if not sys.platform.startswith("linux"):
        return frozenset()
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16_cpu(features: Optional[FrozenSet[str]] = None) -> bool:
    """True if the CPU (default: this one) computes bf16 in hardware (see ``NATIVE_BF16_CPU_FLAGS``)."""
    return bool((cpu_features() if features is None else features) & NATIVE_BF16_CPU_FLAGS)


def cuda_capability(device: Any) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` compute capability of a CUDA device; None for any other device or without CUDA.

    ``device`` is a ``torch.device`` or anything ``torch.device()`` accepts (``"cuda:1"``); a bare ``"cuda"``
    means the current CUDA device. Only a CUDA device makes this touch CUDA.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return _capability_of(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)
