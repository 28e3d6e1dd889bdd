"""Decentralized SGD (``comm.algorithm: decentralized``), synchronous and in full precision.

Lian et al., 2017, "Can Decentralized Algorithms Outperform Centralized Algorithms?" (D-PSGD), as Bagua runs it:
no gradient is allreduced; at each real step every rank replaces its weights by the average of its own and its
peers' weights *as they were when the step's forward began*, then applies its own gradient (computed at those
weights) with its own optimizer:

    x_{t+1} = mean(x_t over the rank and its peers) - lr * g(x_t)

- ``peers: all``: the average over every rank (an allreduce of the weights);
- ``peers: shift_one``: the average with one peer that changes each step. The ranks of the lower half are paired
  with those of the upper half, the pairing shifted by one each exchange (rank ``r < n/2`` with
  ``n/2 + (r + t) mod n/2``), so after ``n/2`` steps every rank has met every rank of the other half; it needs an
  even number of ranks.

The exchange is issued from a forward pre-hook (the first training forward after a real step) on the comm
worker thread of `aiak.comm.allreduce.hooks`, over a process group of its own (DDP's own collectives on the main
thread never interleave with it), so it runs while the forward and backward compute; the step controller waits
for it at the real step (`Decentralized.at_real_step`) and copies the average into the parameters before
the optimizer's update. A step skipped for inf/NaN gradients still takes the average (every rank exchanged).
The gradient hook does nothing (`aiak.comm.allreduce.hooks.CommState.scope` ``rank``); buffers (BatchNorm
statistics) and optimizer state stay local, as in Bagua, and DDP's broadcast of buffers is off. Bagua's
asynchronous variant is not built (it hung and raced there, and assumes endless data).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from aiak.comm.algorithms.base import CommAlgorithm
from aiak.comm.allreduce.hooks import CommState, Future, copy_into, flat_copy, run_in_worker, wait_watched
from aiak.util.config import choices

PEERS = ("shift_one", "all")


@dataclass
class DecentralizedConfig:
    """``comm.decentralized``: ``peers: shift_one`` averages with one peer that changes each step (the ranks of
    the lower half paired with those of the upper half, the pairing shifted by one each step; an even number of
    ranks), ``all`` with every rank (an allreduce of the weights)."""

    peers: str = field(default="shift_one", metadata=choices(*PEERS))


def shift_one_peer(rank: int, world: int, exchange: int) -> int:
    """The rank ``rank`` averages with at exchange number ``exchange`` (``world`` even; see the module)."""
    half = world // 2
    if rank < half:
        return half + (rank + exchange) % half
    return (rank - half - exchange) % half


class Decentralized(CommAlgorithm):
    """The weight exchange of one DDP model; attached to its optimizer's step controller by ``aiak.optimize``."""

    name = "decentralized"
    trades = ("no gradient allreduce: each step every rank averages its weights with its peers (one peer that "
              "changes each step, or all), overlapped with the forward and backward: latency hidden and one "
              "peer's traffic for replicas that agree only on average (Lian et al., 2017, D-PSGD)")
    settings = DecentralizedConfig
    own_connections = True
    join_would_miss = "weight exchanges"

    def __init__(self, ddp: torch.nn.Module, state: CommState, peers: str, group):
        if peers not in PEERS:
            raise ValueError(f"comm.decentralized.peers must be one of {list(PEERS)}, got {peers!r}")
        self.ddp, self.state, self.peers, self.group = ddp, state, peers, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if peers == "shift_one" and self.world % 2:
            raise ValueError(f"comm.decentralized.peers shift_one pairs ranks, and this run has {self.world} (odd); "
                             "use peers: all, or an even number of ranks")
        self.exchanges = 0        # exchanges issued (shift_one's pairing follows it)
        self._inflight: Optional[Future] = None
        state.set_scope("rank")
        ddp.broadcast_buffers = False
        self._hook = ddp.register_forward_pre_hook(self._on_forward)

    # -- before anything is built ------------------------------------------------------------------------
    @classmethod
    def problems(cls, comm: Any, where: Callable[[str], str], path: str) -> List[str]:
        problems, at = super().problems(comm, where, path), where(path + "algorithm")
        if comm.hierarchical is True:
            problems.append(f"{at}: decentralized exchanges weights between ranks directly; {path}hierarchical true "
                            "applies to the allreduce algorithms: set it to auto or false")
        if comm.compression != "none":
            problems.append(f"{at}: decentralized exchanges weights in full precision; set {path}compression to none")
        return problems

    @classmethod
    def runs_here(cls, comm: Any, topology, process_group) -> type:
        super().runs_here(comm, topology, process_group)
        if comm.decentralized.peers == "shift_one" and topology.world_size % 2:
            raise ValueError(f"aiak.comm: comm.decentralized.peers shift_one pairs ranks, and this run has "
                             f"{topology.world_size} (odd); use peers: all, or an even number of ranks")
        return cls

    @classmethod
    def from_settings(cls, ddp, state: CommState, comm: Any) -> "Decentralized":
        """Collective: every rank creates the exchange's process group here (DDP's collectives on the main thread
        never interleave with the exchange on it)."""
        group = dist.new_group(list(range(dist.get_world_size(ddp.process_group))),
                               backend=dist.get_backend(ddp.process_group))
        return cls(ddp, state, comm.decentralized.peers, group)

    def params(self) -> List[torch.Tensor]:
        return [p for p in self.ddp.module.parameters() if p.requires_grad]

    def peer(self, exchange: int) -> Optional[int]:
        """This rank's peer at exchange number ``exchange`` (``None``: all ranks)."""
        return shift_one_peer(self.rank, self.world, exchange) if self.peers == "shift_one" else None

    # -- the exchange ------------------------------------------------------------------------------------
    def _on_forward(self, module, args) -> None:
        if self._inflight is None and torch.is_grad_enabled() and module.training:
            self._inflight = self._issue()

    def _issue(self) -> Future:
        flat = flat_copy(self.params())
        peer, self.exchanges = self.peer(self.exchanges), self.exchanges + 1
        return run_in_worker(self.state, flat, lambda x: self._average(x, peer), key="weights")

    def _average(self, x: torch.Tensor, peer: Optional[int]) -> None:
        if peer is None:
            wait_watched(dist.all_reduce(x, group=self.group, async_op=True), "allreduce of the weights", self.group)
            x.div_(self.world)
            return
        theirs = torch.empty_like(x)
        works = [dist.isend(x, dist.get_global_rank(self.group, peer), group=self.group),
                 dist.irecv(theirs, dist.get_global_rank(self.group, peer), group=self.group)]
        for work in works:
            wait_watched(work, f"exchange of the weights with rank {dist.get_global_rank(self.group, peer)}",
                         self.group)
        x.add_(theirs).div_(2)

    # -- the step controller's calls ---------------------------------------------------------------------
    def at_real_step(self) -> None:
        """The average of this step's exchange becomes the weights (issued now if no training forward did)."""
        fut, self._inflight = self._inflight or self._issue(), None
        copy_into(self.params(), fut.wait())

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"algorithm": "decentralized", "exchanges": self.exchanges - (self._inflight is not None)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_saved(state)
        self.exchanges = int(state["exchanges"]) + (self._inflight is not None)

    def describe(self) -> str:
        return f"decentralized SGD: peers {self.peers}"
