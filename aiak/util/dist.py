"""Whether ranks exist (`process_group_exists`, `world_size`, `is_distributed`: the one place
aiak asks), and how they agree: the few collectives aiak issues for itself (not for the user's gradients), and
where their small tensors live. Each collective is the identity outside a process group of more than one rank, so
single-process code calls them unconditionally; inside one, every rank of ``group`` (torch's default group when
None) must call them at the same point, in the same order.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist


def device_type_for_backend(backend: str) -> str:
    """``cpu`` if one of the backends in ``backend`` (``gloo``, or ``cpu:gloo,cuda:nccl``) runs CPU tensors,
    else ``cuda``: NCCL has no CPU path, so CPU tensors in a collective on an NCCL group crash."""
    names = [part.rsplit(":", 1)[-1].strip().lower() for part in str(backend).split(",")]
    capability = getattr(dist.Backend, "backend_capability", {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]})
    return "cpu" if any("cpu" in capability.get(name, ()) for name in names) else "cuda"


def group_device(group=None) -> torch.device:
    """The device for aiak's own tensors in collectives on ``group``: CPU where the group can, else the current
    CUDA device (with NCCL, ``torch.cuda.set_device(local_rank)`` makes that the gradient device)."""
    if device_type_for_backend(dist.get_backend(group)) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's and tensor parallelism's parameters); False where torch was built
    without torch.distributed."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def process_group_exists() -> bool:
    """torch's default process group is initialized (of any size, one rank included)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    """The ranks of ``group`` (or of the default group); 1 without a process group."""
    return dist.get_world_size(group) if process_group_exists() else 1


def is_distributed(group=None) -> bool:
    """A process group of more than one rank exists (``group``, or the default one)."""
    return world_size(group) > 1


def on_rank0(group=None) -> bool:
    """This process is rank 0 of ``group``, or no process group of more than one rank exists."""
    return not is_distributed(group) or dist.get_rank(group) == 0


def max_across_ranks(values: Sequence[float], group=None) -> List[float]:
    """Each value's largest across the ranks, on every rank: the ranks act on the slowest rank's timings and on
    any rank's failure, so that they all take the same branch (a rank that went alone would leave the others
    waiting in a collective)."""
    if not is_distributed(group):
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def rank0_index(index: int, group=None) -> int:
    """Rank 0's ``index`` on every rank: a choice made on rank 0 (the winner of a tuning), followed by all."""
    if not is_distributed(group):
        return int(index)
    t = torch.tensor([int(index)], dtype=torch.int64, device=group_device(group))
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())


def rank0_object(read: Callable[[], Any], group=None) -> Any:
    """What ``read()`` returns on rank 0, on every rank (only rank 0 calls it): a cache entry read from rank 0's
    disk, so that the ranks agree even without a shared file system."""
    if not is_distributed(group):
        return read()
    box = [read() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group,
                               device=group_device(group))
    return box[0]
