"""``comm.algorithm: allreduce``: every step's gradients averaged across all ranks, DDP's arithmetic.

How the average travels (flat or hierarchical, compressed, over several connections, CPU-Reduce, chosen by the
comm autotuner) is `aiak.comm.allreduce`; with none of that asked for, DDP's built-in C++ allreduce is the
fastest flat fp32 path and no hook is registered.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from aiak.comm.algorithms.base import CommAlgorithm
from aiak.comm.allreduce.hooks import CommState

# The transport of aiak's hook that is exactly DDP's own: flat, uncompressed, one connection, no CPU-Reduce.
PLAIN_ROUTE = (False, "none", 1, False)


class AllReduce(CommAlgorithm):
    name = "allreduce"
    trades = "every step's gradients averaged across all ranks (DDP's arithmetic): nothing traded"
    changes_training = False
    steps_with_optimizer = False
    needs_aiak_ddp = False
    half_gradients = True

    def __init__(self, state: CommState):
        self.state = state

    @classmethod
    def problems(cls, comm: Any, where: Callable[[str], str], path: str) -> List[str]:
        return []

    @classmethod
    def runs_here(cls, comm: Any, topology, process_group) -> type:
        return cls

    @classmethod
    def from_settings(cls, ddp, state: CommState, comm: Any) -> "AllReduce":
        return cls(state)

    def bucket_hook(self, comm: Any) -> Optional[Tuple[Any, Callable]]:
        if not comm.autotune and not comm.deadlock_guard and self.state.route == PLAIN_ROUTE:
            return None  # DDP's built-in C++ allreduce
        return super().bucket_hook(comm)

    def describe(self) -> str:
        return self.state.describe()
