"""The ``comm:`` section of a strategy: how gradients travel under DDP (:func:`aiak.comm.wrap_distributed`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from aiak.comm.algorithms import REGISTRY, AllReduce
from aiak.comm.algorithms.decentralized import DecentralizedConfig
from aiak.comm.algorithms.local_sgd import LocalSGDConfig
from aiak.comm.algorithms.powersgd import PowerSGDConfig
from aiak.comm.allreduce.compression import COMPRESSIONS
from aiak.comm.diagnostics.stall import STALL_WARN_S
from aiak.util.config import StrategyError, Where, choices, section_problems


@dataclass
class CommConfig:
    """Communication under DDP (only used when a process group with world size > 1 exists).

    ``autotune`` times candidate algorithms (and, in ``comm`` perf mode, bucket sizes) during warm-up; rank 0
    decides, every rank follows, and the result is cached per model, cluster and torch version. int8 changes
    the numerics, so the tuner only considers it when ``tune_int8`` is true. ``deadlock_guard`` is a debug
    mode: ranks compare fingerprints of their collectives and raise instead of hanging (``timeout_s``).
    ``pipeline_mb`` cuts hierarchical buckets into chunks that overlap the intra- and inter-node steps (MB of
    fp32 values; int8 chunks hold twice as many values; 0 = whole buckets); ``compress_intra`` also compresses
    the intra-node steps (fp16/bf16); ``int8_block`` is the number of values sharing one min/scale.
    ``stall_warn_s``: a collective of aiak's communication hook that has waited this long warns which ranks
    have not reached it and where they were last seen, then waits on (:mod:`aiak.comm.diagnostics.stall`; 0 = off).
    DDP's own allreduce (flat fp32 with nothing else set) runs without aiak's hook, so it is not watched.
    ``connections``: TCP connections per peer for the stage that crosses nodes (gloo; each cut into that many
    pieces sent at once, :mod:`aiak.comm.allreduce.connections`): an integer, or ``auto``: the comm autotuner measures
    one against several (one without autotuning). NCCL's sockets are NCCL's own settings (``aiak doctor``).
    ``cpu_reduce``: ACSpeed's CPU-Reduce for NCCL jobs (GPUs sharing PCIe with the NIC): the hierarchical
    algorithm with its cross-node stage on pinned host copies over gloo. ``auto``: the comm autotuner measures it
    beside NCCL's own stages (off without autotuning); ``true``: used; ``false``: never. It applies to CUDA
    gradients on an NCCL group with hierarchical groups (several nodes of several ranks); gloo jobs already reduce
    on the host.
    ``find_unused_parameters``: passed to the DistributedDataParallel aiak builds, as a script passes it to its
    own: a model with parameters its forward does not use on every step (a conditional branch, a head kept for
    later) needs it under every algorithm, or torch stops at "Expected to have finished reduction".
    ``algorithm``: how ranks synchronise, a name of :data:`aiak.comm.algorithms.REGISTRY`: ``allreduce`` (the hooks
    above), or one that changes the training and is only ever named by a profile or the user, each with its section
    of settings (the field of the same name).
    """

    hierarchical: Union[str, bool] = field(default="auto", metadata=choices("auto", True, False))
    compression: str = field(default="none", metadata=choices(*COMPRESSIONS))
    bucket_mb: float = 25.0
    autotune: bool = False
    perf_mode: str = field(default="comm", metadata=choices("comm", "step"))
    tune_steps: int = 3
    tune_cache: Optional[str] = None
    tune_int8: bool = False
    deadlock_guard: bool = False
    timeout_s: float = 300.0
    compress_intra: bool = False
    int8_block: int = 2048
    pipeline_mb: float = 2.0
    stall_warn_s: float = STALL_WARN_S
    connections: Union[str, int] = field(default="auto", metadata=choices("auto", also="an integer >= 1"))
    cpu_reduce: Union[str, bool] = field(default="auto", metadata=choices("auto", True, False))
    find_unused_parameters: bool = False
    algorithm: str = field(default=AllReduce.name, metadata=choices(*REGISTRY))
    local_sgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    decentralized: DecentralizedConfig = field(default_factory=DecentralizedConfig)
    powersgd: PowerSGDConfig = field(default_factory=PowerSGDConfig)

    def _problems(self, where: Where, path: str) -> List[str]:
        problems = []
        for key, low, strict in (("bucket_mb", 0, True), ("timeout_s", 0, True), ("tune_steps", 1, False),
                                 ("int8_block", 1, False), ("pipeline_mb", 0, False),
                                 ("stall_warn_s", 0, False)):
            value = getattr(self, key)
            if value < low or (strict and value == low):
                problems.append(f"{where(path + key)} must be {'>' if strict else '>='} {low}, got {value}")
        if isinstance(self.connections, int) and not isinstance(self.connections, bool) and self.connections < 1:
            problems.append(f"{where(path + 'connections')} must be 'auto' or an integer >= 1, got {self.connections}")
        if self.cpu_reduce is True and self.hierarchical is False:
            problems.append(f"{where(path + 'cpu_reduce')}: true is a form of the hierarchical algorithm, but "
                            f"{path}hierarchical is false; set hierarchical to auto or true, or "
                            "cpu_reduce to auto or false")
        algorithm = REGISTRY.get(self.algorithm)  # (an unknown name is reported with the choices)
        if algorithm is not None:
            problems.extend(algorithm.problems(self, where, path))
        return problems


def check_comm(comm: CommConfig, source: str) -> None:
    """Types, choices and ranges of a ``CommConfig``, also one built in code rather than from YAML."""
    problems = section_problems(comm, Where(source, {}), "comm.")
    if problems:
        raise StrategyError(problems)
