"""CPU affinity: bind each local rank to the cores nearest its GPU, or to an even share of the cores.

With several ranks per node, unbound data-loading and host-side threads of different ranks migrate across
sockets and compete for the same cores. With NVML (``pynvml``, optional) each rank takes the CPU set NVML
reports as closest to its GPU (``nvmlDeviceGetCpuAffinity``), intersected with the cores this process may
use; otherwise the allowed cores are split evenly, in order, across the local ranks. torch's intra-op
thread count is set to the number of cores kept, so the ranks do not oversubscribe the node.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

import torch

from aiak.util.warn import warn


def _local_rank_and_size() -> tuple:
    rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return rank, size


def even_split(cores: List[int], local_rank: int, local_size: int) -> List[int]:
    """Contiguous share ``local_rank`` of ``cores`` (the first ``len % size`` shares get one more core)."""
    if local_size <= 0 or not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, {local_size}), got {local_rank}")
    cores = sorted(cores)
    if len(cores) < local_size:  # fewer cores than ranks: share round-robin
        return [cores[local_rank % len(cores)]]
    base, extra = divmod(len(cores), local_size)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (1 if local_rank < extra else 0)]


def _nvml_cores(local_rank: int) -> Optional[List[int]]:
    """Cores NVML reports nearest to the GPU of this local rank, or None without CUDA/NVML."""
    try:
        if not torch.cuda.is_available():
            return None
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = local_rank % torch.cuda.device_count()
        if visible:
            token = visible.split(",")[index].strip()
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(token)) if token.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(token))
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        words = pynvml.nvmlDeviceGetCpuAffinity(handle, (os.cpu_count() + 63) // 64)
        return [w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1]
    except Exception as e:  # noqa: BLE001 - NVML quirks must not stop training
        warn(f"aiak.comm: NVML CPU affinity unavailable ({e}); splitting cores evenly")
        return None


def apply_cpu_affinity(enabled: bool, device: Any = None) -> str:
    """Bind this process per the module docstring; returns a one-line description of what was done.

    ``device`` is not read (the cores follow the local rank): it makes the signature every process knob's."""
    if not enabled:
        return "cpu affinity: off"
    if not hasattr(os, "sched_setaffinity"):
        warn("aiak.comm: cpu_affinity needs os.sched_setaffinity (Linux); skipped")
        return "cpu affinity: skipped (no sched_setaffinity on this platform)"
    local_rank, local_size = _local_rank_and_size()
    allowed = sorted(os.sched_getaffinity(0))
    near = _nvml_cores(local_rank)
    cores = sorted(set(near) & set(allowed)) if near else []
    how = "NVML GPU-nearest cores"
    if not cores:
        cores = even_split(allowed, local_rank, local_size)
        how = f"even split of {len(allowed)} allowed cores over {local_size} local rank(s)"
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return f"cpu affinity: local rank {local_rank} bound to cores {_ranges(cores)} ({how}); torch threads={len(cores)}"


def _ranges(cores: List[int]) -> str:
    out, start, prev = [], None, None
    for c in cores:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = c
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)
