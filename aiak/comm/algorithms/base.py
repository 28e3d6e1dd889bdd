"""The interface of a communication algorithm: what ``comm.algorithm`` names.

An algorithm decides *what* the ranks of one DDP model synchronise, and when; `aiak.comm.allreduce` is how
averaged gradients travel. Each algorithm is one class of this interface in its own file, registered by name in
`aiak.comm.algorithms.REGISTRY`; validation (``comm.algorithm``'s choices and the settings it cannot run
with), ``aiak explain`` (what it trades) and DDP's wrapping (`aiak.comm.wrap_distributed`) read the class,
so nothing outside the registry and the algorithm's file lists or branches on the names (the shape of torch's
``DDPCommHookType`` and Composer's algorithm registry).

Its life, in order:

1. **Before anything is built** (class methods): `problems` (settings it cannot run with, every one at once,
   when the strategy is validated), `runs_here` (what runs on this topology: local SGD on one node is
   allreduce; what cannot run here is refused with the reason), `bucket_mb` (DDP's bucket size).
2. **Built** with the DDP model and its `CommState` (`from_settings`).
3. **At a gradient bucket**: the hook `bucket_hook` returns, registered on DDP (``None``: DDP's own).
4. **At a real optimizer step** (the step controller calls them when `steps_with_optimizer`):
   `at_real_step` before the update, `after_real_step` after it.
5. **In a checkpoint and at resume**: `state_dict` travels in the optimizer's ``state_dict()`` (the step
   controller's extras); `load_state_dict` takes it back and refuses another algorithm's.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch.distributed as dist

from aiak.comm.allreduce.hooks import CommState, comm_hook
from aiak.util.warn import warn


class CommAlgorithm:
    """One way of synchronising the ranks of a DDP model (see the module docstring)."""

    name: ClassVar[str] = ""
    trades: ClassVar[str] = ""                # what it gives up for what (``aiak explain`` shows it)
    settings: ClassVar[Optional[type]] = None  # the dataclass of its section ``comm.<name>``, if it has one
    changes_training: ClassVar[bool] = True    # not DDP's arithmetic: only a profile or the user ever names it
    steps_with_optimizer: ClassVar[bool] = True  # acts at, or keeps state across, real steps (the step controller)
    needs_aiak_ddp: ClassVar[bool] = True      # built with the DDP aiak wraps (not on a script's own DDP)
    half_gradients: ClassVar[bool] = False     # under O2 its gradient averages travel in the half dtype
    wants_node_groups: ClassVar[bool] = False  # the intra- and inter-node groups, wherever the topology has them
    join_would_miss: ClassVar[str] = ""        # what a rank out of batches would miss at its peers' steps (Join
                                               # refused), or "" where DDP's Join shadows everything it sends
    own_connections: ClassVar[bool] = False    # sends over one connection per peer (comm.connections is the
                                               # allreduce route's)

    # -- before anything is built ------------------------------------------------------------------------
    @classmethod
    def problems(cls, comm: Any, where: Callable[[str], str], path: str) -> List[str]:
        """The settings of ``comm`` (a ``CommConfig``) this algorithm cannot run with, each with what to change.
        Every algorithm but allreduce refuses the allreduce path's tuner and CPU-Reduce."""
        at, problems = where(path + "algorithm"), []
        if comm.autotune:
            problems.append(f"{at}: {cls.name} does not run with {path}autotune true (the autotuner times allreduce "
                            f"algorithms against each other); set autotune false or algorithm allreduce")
        if comm.cpu_reduce is True:
            problems.append(f"{at}: {cls.name} does not run with {path}cpu_reduce true (a form of the allreduce "
                            "algorithm); set cpu_reduce to auto or false")
        return problems

    @classmethod
    def runs_here(cls, comm: Any, topology, process_group) -> type:
        """The algorithm that runs for ``comm`` on ``topology``: this one, or a simpler one that does the same
        here; settings that cannot apply are warned of, a run it cannot serve is refused (``ValueError``)."""
        if process_group is not None and process_group is not dist.group.WORLD:
            raise ValueError(f"aiak.comm: comm.algorithm {cls.name} runs on the default (world) group; this DDP was "
                             "given a process_group of its own: leave process_group out, or use algorithm allreduce")
        if cls.own_connections and comm.connections not in ("auto", 1):
            warn(f"aiak.comm: comm.connections: {comm.connections} applies to the allreduce algorithms' cross-node "
                 f"stage; {cls.name} sends over one connection per peer")
        return cls

    @classmethod
    def bucket_mb(cls, model, comm: Any) -> float:
        """DDP's bucket size under this algorithm, in MB."""
        return comm.bucket_mb

    @classmethod
    def from_settings(cls, ddp, state: CommState, comm: Any) -> "CommAlgorithm":
        """The algorithm of ``ddp`` (built by aiak, with ``state``), from its settings in ``comm``."""
        raise NotImplementedError

    # -- at a gradient bucket ----------------------------------------------------------------------------
    def bucket_hook(self, comm: Any) -> Optional[Tuple[Any, Callable]]:
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``; ``None`` keeps DDP's own
        allreduce. By default aiak's hook, averaging over the ranks of ``CommState.scope``."""
        return self.state, comm_hook

    # -- at real steps (the step controller's calls) -----------------------------------------------------
    def at_real_step(self) -> None:
        """Before the optimizer's update of a real step."""

    def after_real_step(self, updated: bool) -> None:
        """After a real step (``updated`` False: skipped for inf/NaN gradients)."""

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"algorithm": self.name}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_saved(state)

    def check_saved(self, state: Dict[str, Any]) -> None:
        """``state`` was saved by this algorithm, or a ``ValueError`` says whose it is."""
        if state.get("algorithm") != self.name:
            raise ValueError(f"this checkpoint's comm algorithm is {state.get('algorithm')!r}, not {self.name}")

    def describe(self) -> str:
        return self.name

    def describe_with_transport(self) -> str:
        """`describe`, and how its averages travel where aiak's allreduce path carries them."""
        return self.describe()
