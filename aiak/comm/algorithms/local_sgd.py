"""Local SGD with hierarchical model averaging (``comm.algorithm: local_sgd``).

Lin et al., 2020, "Don't Use Large Mini-Batches, Use Local SGD" (post-local SGD: synchronous SGD for a warm-up,
then local steps with periodic averaging), in the hierarchical form of torch's ``post_localSGD_hook`` with a
per-node subgroup plus ``PeriodicModelAverager``:

- for ``warmup_steps`` real steps the communication hook averages every bucket over all ranks, as ``allreduce``;
- then the hook averages gradients inside each node only (`aiak.comm.allreduce.hooks.CommState.scope` ``node``;
  with one rank per node nothing is sent at all), so the ranks of a node stay identical while nodes drift apart;
- after the real step of index ``s`` (counted from 0), for ``s >= warmup_steps`` and ``(s - warmup_steps)`` a
  multiple of ``period``, the weights are averaged across nodes: the step controller calls `after_real_step`,
  which averages one flat float32 buffer of the trainable parameters **and the floating buffers** (BatchNorm's
  running statistics, which torch's averager leaves as each rank has them) through the same hook machinery
  (`aiak.comm.allreduce.hooks.average`), so the hierarchical algorithm, several connections and fp16/bf16
  transport apply to it.

With fp16/bf16 transport the first average sends float32 values and every later one sends the change since the
previous average (which every rank holds identically, kept in float32): a weight of magnitude 1 sent as fp16 would
lose everything past its 11th bit, its change over a period loses the same fraction of a far smaller number. A change
beyond fp16's range (a BatchNorm variance of raw features of standard deviation 3000 rises by ~1e6 in a period) is
averaged again in float32 by the hook machinery, as every fp16 sum aiak casts for (it overflowed to inf, then NaN, on
every rank before). During the local phase DDP's broadcast of buffers from rank 0 at every forward is off (a
collective per step, and it would overwrite the averaged statistics).

Real steps are counted by the averager itself, so a step skipped for inf/NaN gradients counts (it was a step for
the schedule); the count travels in the optimizer's ``state_dict()`` (the step controller's extras), so a resumed
run averages on the same steps. ``period: 1`` never gets here: synchronising every step is ``allreduce``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from aiak.comm.algorithms.allreduce import AllReduce
from aiak.comm.algorithms.base import CommAlgorithm
from aiak.comm.allreduce.compression import CAST_DTYPES
from aiak.comm.allreduce.hooks import CommState, average, copy_into, flat_copy
from aiak.util.config import Where
from aiak.util.warn import warn

logger = logging.getLogger("aiak")
AVERAGE_KEY = "local_sgd"  # the key of the weights' average in the hook machinery (never a bucket index)


@dataclass
class LocalSGDConfig:
    """``comm.local_sgd``: after ``warmup_steps`` real steps of ``allreduce``, gradients are averaged inside each
    node every step and the weights and floating buffers across nodes every ``period`` real steps (the first
    average right after the warm-up's last step, as torch's ``PeriodicModelAverager``). ``period: 1`` synchronises
    every step: that is ``allreduce``, and it runs as ``allreduce``."""

    period: int = 8
    warmup_steps: int = 100

    def _problems(self, where: Where, path: str) -> List[str]:
        return [f"{where(path + key)} must be >= {low}, got {getattr(self, key)}"
                for key, low in (("period", 1), ("warmup_steps", 0)) if getattr(self, key) < low]


class LocalSGD(CommAlgorithm):
    """The averager of one DDP model; attached to its optimizer's step controller by ``aiak.optimize``."""

    name = "local_sgd"
    trades = ("after warm-up, gradients averaged inside each node only and the weights (and floating buffers) "
              "averaged across nodes every `period` steps: 1/period of the cross-node traffic for replicas that "
              "drift apart between averages (Lin et al., 2020, 'Don't Use Large Mini-Batches, Use Local SGD')")
    settings = LocalSGDConfig
    half_gradients = True
    wants_node_groups = True
    join_would_miss = "weight averages"

    def __init__(self, ddp: torch.nn.Module, state: CommState, period: int, warmup_steps: int):
        if period < 2:
            raise ValueError(f"local SGD needs period >= 2 (period 1 is allreduce), got {period}")
        self.ddp, self.state = ddp, state
        self.period, self.warmup_steps = period, warmup_steps
        self.steps = 0            # real steps taken
        self.averages = 0         # averages across nodes so far
        self.anchor: Optional[torch.Tensor] = None  # the last average (fp16/bf16 transport only)
        self.broadcast_buffers = getattr(ddp, "broadcast_buffers", False)
        self._enter_phase()

    # -- before anything is built ------------------------------------------------------------------------
    @classmethod
    def problems(cls, comm: Any, where: Callable[[str], str], path: str) -> List[str]:
        problems = super().problems(comm, where, path)
        if comm.compression == "int8":
            problems.append(f"{where(path + 'algorithm')}: local_sgd averages weights across nodes, and int8's error "
                            f"feedback is for gradients; set {path}compression to none, fp16 or bf16")
        return problems

    @classmethod
    def runs_here(cls, comm: Any, topology, process_group) -> type:
        """``allreduce`` where local SGD would synchronise every step anyway (one node, or ``period: 1``); nodes
        of unequal size are refused."""
        super().runs_here(comm, topology, process_group)
        if comm.local_sgd.period == 1:
            logger.info("aiak.comm: local_sgd with period 1 synchronises every step: allreduce")
            return AllReduce
        if topology.num_nodes == 1:
            warn(f"aiak.comm: comm.algorithm local_sgd averages across nodes, and this run has one node "
                 f"({topology.describe()}): every step is synchronous, allreduce runs; use decentralized or "
                 "powersgd to send less inside a node")
            return AllReduce
        if not topology.uniform:
            raise ValueError(f"aiak.comm: comm.algorithm local_sgd needs nodes of equal size (gradients are averaged "
                             f"inside each node); this run's are {[len(n) for n in topology.nodes]}")
        return cls

    @classmethod
    def from_settings(cls, ddp, state: CommState, comm: Any) -> "LocalSGD":
        return cls(ddp, state, comm.local_sgd.period, comm.local_sgd.warmup_steps)

    # -- what is averaged ---------------------------------------------------------------------------------
    def tensors(self) -> List[torch.Tensor]:
        """The trainable parameters, then the floating buffers, in module order (the same on every rank)."""
        module = self.ddp.module
        return [p for p in module.parameters() if p.requires_grad] + \
            [b for b in module.buffers() if b.is_floating_point()]

    @property
    def local(self) -> bool:
        """Past the warm-up: gradients stay inside the node."""
        return self.steps >= self.warmup_steps

    def _enter_phase(self) -> None:
        self.state.set_scope("node" if self.local else "world")
        self.ddp.broadcast_buffers = self.broadcast_buffers and not self.local

    # -- the step controller's calls ---------------------------------------------------------------------
    def after_real_step(self, updated: bool) -> None:
        step, self.steps = self.steps, self.steps + 1
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            self.average()
        self._enter_phase()

    def average(self) -> None:
        """Average the weights and floating buffers across all ranks (ranks of a node hold the same weights, so
        this is the average across nodes; their buffers are averaged too). The stall watch names the real step it
        follows."""
        step = self.steps - 1 if self.steps else None
        tensors = self.tensors()
        with torch.no_grad():
            flat = flat_copy(tensors)
            cast = CAST_DTYPES.get(self.state.compression) is not None
            if cast and self.anchor is not None:  # send the change since the last average
                delta = flat - self.anchor
                average(self.state, delta, key=AVERAGE_KEY, step=step).wait()
                flat = self.anchor.add_(delta)
            else:
                with _uncompressed(self.state):
                    average(self.state, flat, key=AVERAGE_KEY, step=step).wait()
            if cast:
                self.anchor = flat if self.anchor is flat else flat.clone()
            copy_into(tensors, flat)
        self.averages += 1

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"algorithm": "local_sgd", "steps": self.steps, "averages": self.averages,
                "anchor": None if self.anchor is None else self.anchor.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_saved(state)
        self.steps, self.averages = int(state["steps"]), int(state["averages"])
        anchor = state.get("anchor")
        self.anchor = None if anchor is None else anchor.to(self._device()).clone()
        self._enter_phase()

    def _device(self) -> torch.device:
        first = next(iter(self.tensors()), None)
        return first.device if first is not None else torch.device("cpu")

    def describe(self) -> str:
        return f"local SGD: period {self.period}, warm-up {self.warmup_steps} steps"

    def describe_with_transport(self) -> str:
        return f"{self.describe()}, {self.state.describe()} in warm-up and averages"


class _uncompressed:
    """The state's transport without compression for one average (the first, in float32)."""

    def __init__(self, state: CommState):
        self.state, self.saved = state, state.route

    def __enter__(self):
        hierarchical, compression, connections, cpu_reduce = self.saved
        if compression != "none":
            self.state.set_route(hierarchical, "none", connections, cpu_reduce)

    def __exit__(self, *exc):
        if self.state.route != self.saved:
            self.state.set_route(*self.saved)
