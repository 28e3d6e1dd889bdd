"""``comm.engine: fsdp2``: aiak shards the model itself with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`;
Zhao et al., "PyTorch FSDP", VLDB 2023) and points the script's optimizer at the sharded parameters.

Each sharding unit (`sharding_units`) is ``fully_shard``-ed, then the root: a rank keeps 1/N of every parameter
(rows of dimension 0, the last rank's shard shorter where it does not divide), its gradient and its optimizer
state; a unit's full parameters are all-gathered for its forward and again for its backward, and its gradients
reduce-scattered after. Precision O2 becomes FSDP2's ``MixedPrecisionPolicy``: the all-gathered parameters and the
forward's floating inputs in ``precision.dtype``, the sharded fp32 parameters the optimizer's master weights, the
gradients reduced in ``comm.fsdp.reduce_dtype``.

``fully_shard`` replaces every parameter it shards with a new DTensor parameter, so the optimizer ``optimize()``
was given would step the old ones. `repoint_optimizer` swaps them in its param groups, with any state it already
has (moments, momentum) sharded the same way, so the one-line promise holds: the optimizer the script built is the
one that trains.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from aiak.comm.allreduce.compression import CAST_DTYPES
from aiak.comm.config import FSDPConfig
from aiak.comm.sharded import holds

DTYPES = {**CAST_DTYPES, "fp32": torch.float32}  # the dtypes precision.dtype and comm.fsdp.reduce_dtype name


def sharding_units(model: nn.Module, class_names: Sequence[str] = ()) -> List[nn.Module]:
    """The modules sharded one unit each: those of ``class_names`` (a class's own name, or one it derives from:
    aiak's fused subclasses keep their unit), outermost where they nest; else a Hugging Face model's
    ``_no_split_modules``; else the repeated blocks: the children of a ``ModuleList`` or ``Sequential`` when all are
    of one class (two or more) and each is a block of layers (two or more modules holding parameters), the innermost
    where such blocks nest (a Swin stage's blocks, not the stages)."""
    names = set(class_names) or _no_split_modules(model)
    if names:
        found = [m for m in model.modules() if m is not model and any(c.__name__ in names for c in type(m).__mro__)]
        inside = {id(sub) for m in found for sub in m.modules() if sub is not m}
        return [m for m in found if id(m) not in inside]
    blocks = []
    for container in model.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            children = list(container.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1 and all(map(_is_block, children)):
                blocks.extend(children)
    holding = {id(outer) for outer in blocks for inner in blocks if inner is not outer and holds(outer, inner)}
    return [b for b in blocks if id(b) not in holding]


def _is_block(module: nn.Module) -> bool:
    return sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None) >= 2


def _no_split_modules(model: nn.Module) -> set:
    """A Hugging Face model's ``_no_split_modules`` (the classes its own device maps never cut), from the model or
    the first submodule that has them."""
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def shard(model: nn.Module, units: List[nn.Module], cfg: FSDPConfig, param_dtype: Optional[str] = None,
          device=None) -> None:
    """``fully_shard`` each of ``units`` (`sharding_units`), then ``model`` itself, over every rank; ``param_dtype``
    (precision O2's dtype, or None) becomes the ``MixedPrecisionPolicy``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_type = torch.device(device).type if device is not None else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]) \
        if param_dtype else MixedPrecisionPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: Dict[str, torch.Tensor],
                      after: Dict[str, torch.Tensor]) -> int:
    """Swap the parameters ``fully_shard`` replaced (``before`` / ``after``: the model's named parameters) in the
    optimizer's param groups, in place, with any state moved to the new parameter, its tensors of the parameter's
    shape sharded the same way. Returns how many were swapped."""
    from torch.distributed.tensor import distribute_tensor

    new_of = {id(p): after[name] for name, p in before.items() if name in after and after[name] is not p}
    swapped = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = new_of.get(id(p))
            if new is None:
                continue
            params[i] = new
            swapped += 1
            state = optimizer.state.pop(p, None)
            if state:
                optimizer.state[new] = {
                    k: distribute_tensor(v, new.device_mesh, new.placements)
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0 else v
                    for k, v in state.items()}
        group["params"] = list(params)  # a new list: whoever caches the groups' parameters sees them change
    return swapped
