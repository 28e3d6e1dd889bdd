"""LAMB and LARS on DTensor parameters (FSDP2's shards, tensor parallelism): the maths runs on each rank's local
shard, and the per-tensor norms the trust ratios need are the full tensors'.

A trust ratio ``||w|| / ||u||`` (LAMB) or ``||w|| / ||g||`` (LARS) is a norm of the whole tensor, and a rank holds
a shard of it (an uneven one where a dimension does not divide). Each rank takes the squared norms of its local
shards, and `FullSquares` sums them over the ranks holding the other shards: the squares of every tensor of a step
travel in one collective (one per mesh layout: per group of tensors sharded over the same mesh dimensions), as
apex's FusedLAMB takes every norm of a step in one multi-tensor launch. A tensor replicated over its mesh (a
Replicate placement) already holds its full norm and is not summed.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from aiak.util.dist import is_dtensor


def any_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    return any(is_dtensor(t) for t in tensors)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of a DTensor (a view: writing it writes the DTensor), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of each (local) tensor, in fp32, as one 1-D tensor."""
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32).square() for t in tensors])


class FullSquares:
    """Sums the squared norms of local shards over the ranks holding each tensor's other shards.

    ``FullSquares(params)(values)``: ``values`` holds one entry per tensor, repeated ``k`` times in ``params``'
    order (LAMB's weights then updates: ``k = 2``); returned with each entry summed over the mesh dimensions its
    tensor is sharded along.
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        layouts: Dict[tuple, List[int]] = {}
        self._groups: List[Tuple[list, List[int]]] = []
        for i, p in enumerate(params):
            layout = _layout(p)
            if layout is not None:
                layouts.setdefault(layout, []).append(i)
        for (mesh, dims), idx in layouts.items():
            self._groups.append(([mesh.get_group(d) for d in dims], idx))
        self.count = len(params)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        if not self._groups:
            return values
        repeat = values.numel() // max(self.count, 1)
        if len(self._groups) == 1 and len(self._groups[0][1]) == self.count:  # every tensor on one layout
            for group in self._groups[0][0]:
                dist.all_reduce(values, group=group)
            return values
        for groups, idx in self._groups:
            index = torch.tensor([i + r * self.count for r in range(repeat) for i in idx], device=values.device)
            part = values.index_select(0, index)
            for group in groups:
                dist.all_reduce(part, group=group)
            values.index_copy_(0, index, part)
        return values


def full_norms(passes: Sequence[Tuple[Sequence[torch.Tensor], torch.Tensor]]
               ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The full tensors' two norms of each group of a step, their squares in one collective (`FullSquares`).

    ``passes`` holds, per group, its parameters (DTensors) and the squared norms of their local shards, ``[n, 2]``
    (LAMB: weight and update; LARS: weight and gradient). Returns, per group, the two columns' full norms."""
    full = FullSquares([p for params, _ in passes for p in params])(
        torch.cat([s[:, 0] for _, s in passes] + [s[:, 1] for _, s in passes])).sqrt()
    first, second = full.chunk(2)
    out, start = [], 0
    for params, _ in passes:
        end = start + len(params)
        out.append((first[start:end], second[start:end]))
        start = end
    return out


def _layout(p: torch.Tensor):
    """``(mesh, mesh dimensions it is sharded along)`` of a DTensor sharded somewhere, else None."""
    if not is_dtensor(p):
        return None
    dims = tuple(d for d, placement in enumerate(p.placements) if placement.is_shard())
    return (p.device_mesh, dims) if dims else None
