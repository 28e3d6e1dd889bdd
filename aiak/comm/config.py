"""The ``comm:`` section of a strategy: how gradients travel under DDP (:func:`aiak.comm.wrap_distributed`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

from aiak.comm.allreduce.compression import COMPRESSIONS
from aiak.comm.diagnostics.stall import STALL_WARN_S
from aiak.util.config import StrategyError, Where, choices, section_problems

ALGORITHMS = ("allreduce", "local_sgd", "decentralized", "powersgd")

# What each value of ``comm.algorithm`` trades (``aiak explain`` shows it; none is ever chosen by ``auto``).
ALGORITHM_TRADES = {
    "allreduce": "every step's gradients averaged across all ranks (DDP's arithmetic): nothing traded",
    "local_sgd": "after warm-up, gradients averaged inside each node only and the weights (and floating buffers) "
                 "averaged across nodes every `period` steps: 1/period of the cross-node traffic for replicas that "
                 "drift apart between averages (Lin et al., 2020, 'Don't Use Large Mini-Batches, Use Local SGD')",
    "decentralized": "no gradient allreduce: each step every rank averages its weights with its peers (one peer that "
                     "changes each step, or all), overlapped with the forward and backward: latency hidden and one "
                     "peer's traffic for replicas that agree only on average (Lian et al., 2017, D-PSGD)",
    "powersgd": "gradients sent as rank-r factors with error feedback after warm-up: traffic cut to "
                "r*(rows+cols) per matrix for a low-rank approximation, two sums per bucket in sequence, "
                "hierarchical across nodes (Vogels et al., 2019, PowerSGD)",
}


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


@dataclass
class DecentralizedConfig:
    """``comm.decentralized``: ``peers: shift_one`` averages with one peer that changes each step (the ranks of
    the lower half paired with those of the upper half, the pairing shifted by one each step; an even number of
    ranks), ``all`` with every rank (an allreduce of the weights)."""

    peers: str = field(default="shift_one", metadata=choices("shift_one", "all"))


@dataclass
class PowerSGDConfig:
    """``comm.powersgd``: rank ``rank`` approximations after ``warmup_steps`` real steps of plain allreduce
    (at least 2: DDP rebuilds its buckets after the first step, and the error feedback is tied to them).

    ``bucket_mb``: DDP's bucket size under PowerSGD (``comm.bucket_mb`` is allreduce's). A bucket costs two
    sums one after the other, of a few kilobytes each: on a far link each is a round trip, so ``auto`` puts
    every gradient in one bucket (DDP, given a bucket size, makes its first bucket that size too). A number gives
    buckets of that many MB: more overlap of the backward with the communication, where round trips are cheap
    (a fast network) and the low-rank arithmetic is slow."""

    rank: int = 4
    warmup_steps: int = 100
    bucket_mb: Union[str, float] = field(default="auto", metadata=choices("auto", also="a number of MB > 0"))

    def _problems(self, where: Where, path: str) -> List[str]:
        problems = []
        if self.rank < 1:
            problems.append(f"{where(path + 'rank')} must be >= 1, got {self.rank}")
        if self.bucket_mb != "auto" and self.bucket_mb <= 0:
            problems.append(f"{where(path + 'bucket_mb')} must be 'auto' or a number of MB > 0, got {self.bucket_mb}")
        if self.warmup_steps < 2:
            problems.append(f"{where(path + 'warmup_steps')} must be >= 2 (DDP rebuilds its buckets after the first "
                            f"step, and PowerSGD's residuals are tied to them), got {self.warmup_steps}")
        return problems


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
    have not reached it and where they were last seen, then waits on (:mod:`aiak.comm.diagnostics.stall`; 0 = off). DDP's
    own allreduce (flat fp32 with nothing else set) runs without aiak's hook, so it is not watched.
    ``connections``: TCP connections per peer for the stage that crosses nodes (gloo; each cut into that many
    pieces sent at once, :mod:`aiak.comm.allreduce.connections`): an integer, or ``auto``: the comm autotuner measures one
    against several (one without autotuning). NCCL's sockets are NCCL's own settings (``aiak doctor``).
    ``cpu_reduce``: ACSpeed's CPU-Reduce for NCCL jobs (GPUs sharing PCIe with the NIC): the hierarchical
    algorithm with its cross-node stage on pinned host copies over gloo. ``auto``: the comm autotuner measures it
    beside NCCL's own stages (off without autotuning); ``true``: used; ``false``: never. It applies to CUDA
    gradients on an NCCL group with hierarchical groups (several nodes of several ranks); gloo jobs already reduce
    on the host.
    ``find_unused_parameters``: passed to the DistributedDataParallel aiak builds, as a script passes it to its
    own: a model with parameters its forward does not use on every step (a conditional branch, a head kept for
    later) needs it under every algorithm, or torch stops at "Expected to have finished reduction".
    ``algorithm``: how ranks synchronise (:data:`ALGORITHM_TRADES`): ``allreduce`` (the hooks above), or one that
    changes the training and is only ever named by a profile or the user: ``local_sgd``
    (:mod:`aiak.comm.algorithms.local_sgd`), ``decentralized`` (:mod:`aiak.comm.algorithms.decentralized`), ``powersgd``
    (:mod:`aiak.comm.algorithms.powersgd`), each with its section of settings.
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
    algorithm: str = field(default="allreduce", metadata=choices(*ALGORITHMS))
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
        problems.extend(self._algorithm_problems(where, path))
        return problems

    def _algorithm_problems(self, where: Where, path: str) -> List[str]:
        """The settings ``algorithm`` cannot run with, each with what to change."""
        algorithm, problems = self.algorithm, []
        if algorithm == "allreduce":
            return problems
        at = where(path + "algorithm")
        if self.autotune:
            problems.append(f"{at}: {algorithm} does not run with {path}autotune true (the autotuner times allreduce "
                            f"algorithms against each other); set autotune false or algorithm allreduce")
        if self.cpu_reduce is True:
            problems.append(f"{at}: {algorithm} does not run with {path}cpu_reduce true (a form of the allreduce "
                            "algorithm); set cpu_reduce to auto or false")
        if algorithm == "decentralized" and self.hierarchical is True:
            problems.append(f"{at}: decentralized exchanges weights between ranks directly; {path}hierarchical true "
                            "applies to the allreduce algorithms: set it to auto or false")
        if algorithm in ("decentralized", "powersgd"):
            if self.compression != "none":
                what = "exchanges weights in full precision" if algorithm == "decentralized" else \
                    "is a compression of its own"
                problems.append(f"{at}: {algorithm} {what}; set {path}compression to none")
        if algorithm == "local_sgd" and self.compression == "int8":
            problems.append(f"{at}: local_sgd averages weights across nodes, and int8's error feedback is for "
                            f"gradients; set {path}compression to none, fp16 or bf16")
        return problems


def check_comm(comm: CommConfig, source: str) -> None:
    """Types, choices and ranges of a ``CommConfig``, also one built in code rather than from YAML."""
    problems = section_problems(comm, Where(source, {}), "comm.")
    if problems:
        raise StrategyError(problems)
