"""This machine's CPU: its flags and model name (``/proc/cpuinfo``), the cores this process may use, and whether it
computes bf16 in hardware. Nothing is read at import, and nothing here imports torch (``aiak doctor`` reads the
CPU on a machine whose torch may be broken).
"""
from __future__ import annotations

import functools
import os
import platform
import sys
from typing import Dict, FrozenSet, Optional, Tuple

CPUINFO = "/proc/cpuinfo"

# CPU flags (as /proc/cpuinfo spells them) under which oneDNN runs bf16 convolutions and matmuls in
# hardware: AVX512-BF16 (Cooper Lake, Zen 4 and later), AMX-BF16 (Sapphire Rapids and later), and
# FEAT_BF16 on aarch64 (its "Features" line says "bf16").
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# Flags under which fp16 training may run at hardware speed: AMX-FP16 (Granite Rapids) and aarch64's
# "fphp"/"asimdhp" (neither measured here). AVX512-FP16 alone is not among them: on an Intel Xeon with AVX512-FP16
# and AMX-BF16 but no AMX-FP16, an O1 fp16 step took 55x fp32's on DemoNet, 94x on ResNet-18 and 1.6x on an MLP,
# where O1 bf16 took 0.61x, 0.94x and 0.99x (benchmarks/precision_cpu.py, 10 rounds, torch 2.14.1).
NATIVE_FP16_CPU_FLAGS = frozenset({"amx_fp16", "fphp", "asimdhp"})
FP16_FLAGS_THAT_DO_NOT_HELP = frozenset({"avx512_fp16"})


@functools.lru_cache(maxsize=None)
def cpu_features() -> FrozenSet[str]:
    """The flags of the first CPU listed in ``/proc/cpuinfo`` (Linux), e.g. ``{"avx512f", "avx512_bf16",
    "amx_bf16", "amx_tile", ...}``; an empty set on other systems or when the file cannot be read.

    x86 kernels list them on a ``flags`` line, aarch64 kernels on a ``Features`` line.
    """
    value = _cpuinfo_field(("flags", "Features"))
    return frozenset(value.split()) if value else frozenset()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The ``model name`` line of ``/proc/cpuinfo`` (e.g. "AMD EPYC"), else ``platform.processor()``."""
    return _cpuinfo_field(("model name",)) or platform.processor()


def cpuinfo_fields(text: str) -> Dict[str, str]:
    """``key: value`` lines of a ``/proc/cpuinfo`` text, the first value of each key (the first CPU's)."""
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _cpuinfo_field(keys: Tuple[str, ...]) -> Optional[str]:
    """The value of the first of ``keys`` that ``/proc/cpuinfo`` has; None off Linux or unreadable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            fields = cpuinfo_fields(f.read())
    except OSError:
        return None
    return next((fields[k] for k in keys if k in fields), None)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def has_native_bf16_cpu(features: Optional[FrozenSet[str]] = None) -> bool:
    """True if the CPU (default: this one) computes bf16 in hardware (see ``NATIVE_BF16_CPU_FLAGS``)."""
    return bool((cpu_features() if features is None else features) & NATIVE_BF16_CPU_FLAGS)
