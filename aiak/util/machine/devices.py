"""Devices: the one a model runs on, and what a CUDA device computes in hardware (its capability). Reading them
touches CUDA only for a CUDA device; nothing is read at import. The CPU's facts: `aiak.util.machine.cpu`.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional, Tuple

import torch

# Compute capabilities from which CUDA runs bf16 (Ampere tensor cores), fp16 (Volta tensor cores) and fp8 (Ada and
# Hopper tensor cores) natively.
CUDA_NATIVE_BF16 = (8, 0)
CUDA_NATIVE_FP16 = (7, 0)
CUDA_NATIVE_FP8 = (8, 9)


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


def cuda_info(dev: torch.device) -> Optional[Dict[str, Any]]:
    """Name, capability, device count and memory of the CUDA device ``dev``; None off CUDA."""
    capability = cuda_capability(dev)
    if capability is None:
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "capability": f"{capability[0]}.{capability[1]}",
            "count": torch.cuda.device_count(), "memory_gb": round(props.total_memory / 2 ** 30, 1)}


def model_device(model: Optional[torch.nn.Module], device: Any = None) -> torch.device:
    """``device`` if given, else the device of the model's first parameter, else the CPU."""
    if device is not None:
        return torch.device(device)
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def host_memory_gb() -> float:
    """The host's physical memory in GiB (0.0 where the system does not say)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (AttributeError, ValueError, OSError):
        return 0.0

