"""The ``comm:`` section of a strategy: how gradients travel under DDP (`aiak.comm.wrap_distributed`)."""
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


ENGINES = ("ddp", "fsdp2")


@dataclass
class FSDPConfig:
    """``comm.fsdp``: how aiak shards the model under ``comm.engine: fsdp2`` (`torch.distributed.fsdp.fully_shard`,
    `aiak.comm.fsdp`). ``units``: class names of the modules sharded as one unit each (each all-gathered for its own
    forward and backward, so the peak holds one unit's full parameters); empty: found by structure (a Hugging Face
    model's ``_no_split_modules``, else the repeated blocks of the model's containers: a transformer's layers, a
    ResNet's blocks). The root module is always a unit too (what the others leave: embeddings, heads, norms).
    ``reshard_after_forward``: free each unit's full parameters after its forward (all-gathered again for the
    backward: less memory, one more all-gather per unit); false keeps them to the backward. ``reduce_dtype``: the
    dtype gradients are reduce-scattered in when precision O2 computes in half precision (FSDP2's
    ``MixedPrecisionPolicy``; fp32 keeps the reduction exact)."""

    units: List[str] = field(default_factory=list)
    reshard_after_forward: bool = True
    reduce_dtype: str = field(default="fp32", metadata=choices("fp32", "bf16"))


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
    have not reached it and where they were last seen, then waits on (`aiak.comm.diagnostics.stall`; 0 = off).
    DDP's own allreduce (flat fp32 with nothing else set) runs without aiak's hook, so it is not watched.
    ``connections``: TCP connections per peer for the stage that crosses nodes (gloo; each cut into that many
    pieces sent at once, `aiak.comm.allreduce.connections`): an integer, or ``auto``: the comm autotuner measures
    one against several (one without autotuning). NCCL's sockets are NCCL's own settings (``aiak doctor``).
    ``cpu_reduce``: ACSpeed's CPU-Reduce for NCCL jobs (GPUs sharing PCIe with the NIC): the hierarchical
    algorithm with its cross-node stage on pinned host copies over gloo. ``auto``: the comm autotuner measures it
    beside NCCL's own stages (off without autotuning); ``true``: used; ``false``: never. It applies to CUDA
    gradients on an NCCL group with hierarchical groups (several nodes of several ranks); gloo jobs already reduce
    on the host.
    ``find_unused_parameters``: passed to the DistributedDataParallel aiak builds, as a script passes it to its
    own: a model with parameters its forward does not use on every step (a conditional branch, a head kept for
    later) needs it under every algorithm, or torch stops at "Expected to have finished reduction".
    ``engine``: who keeps the ranks' gradients in step: ``ddp`` (every rank holds the whole model, its gradients and
    optimizer state; gradients allreduced by DistributedDataParallel and the settings above) or ``fsdp2`` (aiak shards
    the model with PyTorch's FSDP2, ``fully_shard``: each rank holds 1/N of the parameters, gradients and optimizer
    state, all-gathered per unit for compute and reduce-scattered after; the settings of ``comm.fsdp``; none of DDP's
    settings above apply).
    ``algorithm``: how ranks synchronise, a name of `aiak.comm.algorithms.REGISTRY`: ``allreduce`` (the hooks
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
    engine: str = field(default="ddp", metadata=choices(*ENGINES))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
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
