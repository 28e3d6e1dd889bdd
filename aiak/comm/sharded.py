"""A model the script sharded before ``aiak.optimize()``: which engine sharded it, and the switches the step
controller turns on it where it would turn a DDP's.

A script shards a model before the aiak line in one of three ways: FSDP2 (`torch.distributed.fsdp.fully_shard`:
each parameter becomes a DTensor sharded over a device mesh, all-gathered for each forward and backward, its
gradient reduce-scattered; Zhao et al., "PyTorch FSDP", VLDB 2023), FSDP1 (the `FullyShardedDataParallel` wrapper:
flattened parameters), or tensor parallelism (`torch.distributed.tensor.parallel.parallelize_module`: DTensor
parameters and no data-parallel engine). The engine the script chose synchronises the gradients already, and DDP
cannot hold DTensors, so aiak never wraps such a model in DDP (`sharding_of` is read before anything is chosen).

For FSDP2, `FSDPSync` stands where the step controller keeps a DDP: ``require_backward_grad_sync`` (a micro-step's
backward keeps its unsharded gradient instead of reduce-scattering it: FSDP2's ``set_requires_gradient_sync``),
``process_group`` (the ranks FSDP averages gradients over, which counted items are summed over), and the tensors
autograd accumulates into during a backward (FSDP2's unsharded parameters, not the sharded ones the optimizer
holds), which counted items weigh and which tell a script's own accumulation apart.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

FSDP2, FSDP1, TENSOR_PARALLEL = "fsdp2", "fsdp1", "dtensor"
AIAK_FSDP2 = "aiak_fsdp2"  # not the script's: aiak shards the model (comm.engine: fsdp2, aiak.comm.fsdp)
ENGINE_NAMES = {FSDP2: "FSDP2 (fully_shard)", FSDP1: "FSDP1 (FullyShardedDataParallel)",
                TENSOR_PARALLEL: "tensor parallelism (DTensor parameters)", AIAK_FSDP2: "FSDP2 (comm.engine: fsdp2)"}


def sharding_of(model) -> Optional[str]:
    """``"fsdp2"``, ``"fsdp1"`` or ``"dtensor"`` for a model sharded by FSDP2, FSDP1 or tensor parallelism (DTensor
    parameters without FSDP), else None. Reads the modules' classes and the parameters' types only: nothing is
    imported unless torch.distributed is available."""
    if not isinstance(model, nn.Module) or not dist.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return FSDP2
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        return FSDP1
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return TENSOR_PARALLEL
    return None


class FSDPSync:
    """The switches of a model FSDP2 shards, which the step controller turns as it turns a DDP's (the controller's
    ``ddp``): whether the coming backward reduce-scatters the gradients, and the ranks they are averaged over."""

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.model = model
        self._fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self._roots = [m for m in self._fsdp if not any(m is not o and holds(o, m) for o in self._fsdp)]
        self._sync = True
        self._group, self.group_problem = _data_parallel_group(self._param_groups())

    @property
    def process_group(self):
        """The ranks FSDP averages the gradients over (None: every rank)."""
        if self.group_problem:
            raise ValueError(self.group_problem)
        return self._group

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, sync: bool) -> None:
        if sync != self._sync:
            for root in self._roots:
                root.set_requires_gradient_sync(sync)
            self._sync = sync

    def _param_groups(self) -> list:
        groups = (m._get_fsdp_state()._fsdp_param_group for m in self._fsdp)
        return [g for g in groups if g is not None]

    def autograd_leaves(self) -> List[torch.Tensor]:
        """The unsharded parameters autograd accumulates a backward's gradients into (FSDP2 makes them at its first
        all-gather and keeps them; their storage is freed between uses): those made so far."""
        return [p._unsharded_param for g in self._param_groups() for p in g.fsdp_params
                if hasattr(p, "_unsharded_param")]

    def when_leaves_appear(self, callback: Callable[[List[torch.Tensor]], None]) -> None:
        """``callback(leaves)`` after each forward that made new unsharded parameters, until all are made (the
        first forward makes them, unless a sharded module sat that one out)."""
        expected = sum(len(g.fsdp_params) for g in self._param_groups())
        seen: set = set()

        def after_forward(module, args, output):
            new = [t for t in self.autograd_leaves() if id(t) not in seen]
            seen.update(id(t) for t in new)
            if new:
                callback(new)
            if len(seen) >= expected:
                handle.remove()
            return None

        handle = self.model.register_forward_hook(after_forward)

    cannot_average_later = (
        "under FSDP2 a backward that ran without its reduce-scatter (a micro-step of aiak's accumulation window) "
        "keeps its gradient inside FSDP, where aiak cannot average it afterwards")


def holds(outer: nn.Module, inner: nn.Module) -> bool:
    """``inner`` is ``outer`` or one of its submodules."""
    return any(m is inner for m in outer.modules())


def _data_parallel_group(param_groups: list):
    """``(group, problem)``: the process group FSDP2 averages gradients over, the mesh's shard group, or every rank
    for a hybrid mesh (HSDP) that spans them all (None: the default group). A hybrid mesh over part of the ranks
    (beside tensor parallelism) has no single group: its problem says so."""
    if not param_groups:
        return None, None
    info = param_groups[0].mesh_info
    if not hasattr(info, "replicate_process_group"):
        return info.shard_process_group, None
    if info.shard_mesh_size * info.replicate_mesh_size == dist.get_world_size():
        return None, None
    return None, ("aiak: counted items are summed over the ranks FSDP2 averages gradients over, and this hybrid mesh "
                  "(replicate x shard, beside tensor parallelism) spans part of the ranks in two groups: shard over a "
                  "one-dimensional data-parallel mesh, or leave count_items out")
