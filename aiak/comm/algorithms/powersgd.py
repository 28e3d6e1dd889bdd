"""PowerSGD (``comm.algorithm: powersgd``): torch's PowerSGD arithmetic in two collectives a bucket, hierarchical
where the run has nodes, safe for loss scaling and checkpoints.

Vogels et al., 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization": each
gradient matrix M (n x m) is sent as rank-r factors P = MQ and Q = M^T P (one power iteration, Q warm-started
from the previous step), with error feedback. The state is torch's ``PowerSGDState`` (residuals, P and Q per
bucket, its random generator and step count) and the arithmetic is that of torch's ``powerSGD_hook``, step for
step (same warm start, same orthogonalization, same random Qs); what differs is how the sums travel. For
``warmup_steps`` real steps the gradients are averaged as they are.

What aiak changes around torch's arithmetic:

- **two collectives a bucket, not three.** torch's hook allreduces the uncompressed tensors (biases, small
  matrices), then the Ps, then the Qs, each after the last. The uncompressed tensors need nothing from the Ps, so
  here they travel in one buffer with them: two round trips a bucket.
- **hierarchical sums.** On a run of several nodes of several ranks each (``comm.hierarchical``: ``auto`` or
  ``true``) each sum is aiak's hierarchical allreduce, uncompressed (`aiak.comm.allreduce.hooks.sum_now`): inside
  the node, then one rank per node across, then inside again; on a far link two messages cross it per sum instead of
  the 2(n-1) of a flat ring over n ranks. The sums are the same up to the order of addition (float rounding).
- **on aiak's comm worker.** Each bucket's work (factors, sums, decompression) is one job of the comm worker
  (`aiak.comm.allreduce.hooks.run_in_worker`): jobs run one after another, so every rank issues the collectives in
  one order (torch's hook, with several buckets in flight, issued them in different orders on different ranks:
  gloo "Received data size doesn't match expected size", measured on a 25M-parameter MLP on 4 ranks), while the
  backward goes on producing the next buckets.
- **no allocation a step.** torch's hook allocates two tensors the size of the bucket every step (the gradients
  with their residual, and the new residual); at 25M values that took 59 ms and 73 ms on one CPU core against
  10 ms and 9 ms written into memory already there (fresh pages fault in). Here the new residual is written into
  the one the step before replaced, once the guard has let that go.
- **a non-finite bucket leaves the state as it was.** torch's hook has no inf/NaN guard: one fp16 overflow puts
  NaN into the bucket's residual and its warm-started Q, and every later step of that bucket is NaN. Here the
  residual, P and Q of a bucket are kept before the bucket runs; the averaged bucket's finiteness is checked
  (`FiniteFlag`, read at the bucket's next call, so CUDA never waits for it) and
  a non-finite result puts them back, as aiak's int8 error feedback does (the loss scaler skips that step).
- **residuals in the gradients' own units.** aiak's loss scaling is undone before a gradient reaches
  its ``.grad`` (`aiak.amp.scaling.root_scaling`), so the hook sees unscaled gradients and a residual means the same after
  the loss scale changes.
- **residuals tied to their bucket's layout.** DDP rebuilds its buckets after the first step, in the order the
  gradients became ready (hence a warm-up of at least 2 steps: the state is tied to the rebuilt buckets). Each
  bucket's layout (which parameters, in which order) is recorded at every step; a bucket whose layout changed
  starts afresh (a new residual and a new random Q) instead of adding one parameter's residual to another's
  gradient. ``powersgd.bucket_mb: auto`` (the default) puts every gradient in one bucket: two round trips a step
  (`PowerSGDConfig`).
- **checkpoints.** The state (step count, residuals, P and Q, the random generator, the layouts) travels in the
  optimizer's ``state_dict()`` (the step controller's extras). A resumed run's DDP starts from its initial buckets
  again (one bucket of every parameter, in another order); its first step runs the recorded buckets
  (`BucketRecord`), so the resumed run continues bit for bit.
"""
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
# two private functions of torch's hook module and PowerSGDState's fields: pinned by
# tests/comm/test_powersgd_torch_pins.py (a torch that changes them fails there, by name)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _orthogonalize, _should_compress

from aiak.comm.algorithms.base import CommAlgorithm
from aiak.comm.allreduce.buckets import BucketRecord, ParameterNumbers, bucket_layout
from aiak.comm.allreduce.compression import FiniteFlag
from aiak.comm.allreduce.hooks import CommState, another_ranks, copy_into, run_in_worker, sum_now
from aiak.util.config import Where, choices
from aiak.util.warn import warn

_Kept = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]  # residual, P, Q


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


class PowerSGD(CommAlgorithm):
    """The communication state of one DDP model: torch's ``PowerSGDState`` plus the guard and the layouts; its
    sums go through ``comm`` (the model's `CommState`: topology and worker)."""

    name = "powersgd"
    trades = ("gradients sent as rank-r factors with error feedback after warm-up: traffic cut to "
              "r*(rows+cols) per matrix for a low-rank approximation, two sums per bucket in sequence, "
              "hierarchical across nodes (Vogels et al., 2019, PowerSGD)")
    settings = PowerSGDConfig
    own_connections = True

    def __init__(self, module: torch.nn.Module, comm: CommState, rank: int, warmup_steps: int, seed: int = 0):
        self.comm = comm
        self.torch_state = PowerSGDState(
            process_group=comm.process_group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            use_error_feedback=True, warm_start=True, random_seed=seed)
        self.rank, self.warmup_steps = rank, warmup_steps
        self.numbers = ParameterNumbers().number(module)  # module order: a layout means the same in a resumed run
        self.buckets = BucketRecord()                                  # bucket index -> layout of its state
        self._pending: Dict[int, Tuple[_Kept, FiniteFlag]] = {}        # bucket -> state before, verdict after
        self._spare: Dict[int, torch.Tensor] = {}                      # bucket -> a residual no longer needed
        self.skipped = 0                                               # buckets whose result was not finite

    # -- before anything is built ------------------------------------------------------------------------
    @classmethod
    def problems(cls, comm: Any, where: Callable[[str], str], path: str) -> List[str]:
        problems = super().problems(comm, where, path)
        if comm.compression != "none":
            problems.append(f"{where(path + 'algorithm')}: powersgd is a compression of its own; set "
                            f"{path}compression to none")
        return problems

    @classmethod
    def runs_here(cls, comm: Any, topology, process_group) -> type:
        super().runs_here(comm, topology, process_group)
        if comm.bucket_mb != type(comm).bucket_mb:
            warn(f"aiak.comm: comm.bucket_mb: {comm.bucket_mb:g} is the allreduce algorithms' bucket size; powersgd's "
                 f"is comm.powersgd.bucket_mb ({comm.powersgd.bucket_mb}): set that one instead")
        return cls

    @classmethod
    def bucket_mb(cls, model: torch.nn.Module, comm: Any) -> float:
        """``comm.powersgd.bucket_mb`` in MB, or for ``auto`` one bucket larger than every gradient together
        (`PowerSGDConfig`)."""
        setting = comm.powersgd.bucket_mb
        if setting != "auto":
            return float(setting)
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return gradient_bytes / 2**20 + 1.0

    @classmethod
    def from_settings(cls, ddp, state: CommState, comm: Any) -> "PowerSGD":
        return cls(ddp.module, state, comm.powersgd.rank, comm.powersgd.warmup_steps)

    def bucket_hook(self, comm: Any):
        return self, powersgd_hook

    # -- the hook ----------------------------------------------------------------------------------------
    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future:
        return self.buckets.run(bucket, bucket_layout(bucket, self.numbers), self._run, forget=self._forget)

    def _run(self, bucket, layout=None) -> torch.futures.Future:
        """``bucket`` (DDP's, or a recorded one on a resumed run's first step) averaged on the comm worker (plainly
        in the warm-up, as factors after it), its state kept to be put back if the result is not finite."""
        index, s = bucket.index(), self.torch_state
        self._settle(index)
        kept = self._keep(index)
        if s.iter < s.start_powerSGD_iter:
            work = self._average
        else:
            work = functools.partial(self._compress, index, bucket.gradients())
        if bucket.is_last():
            s.iter += 1

        def verdict(done: torch.futures.Future) -> torch.Tensor:
            averaged = done.value()
            self._pending[index] = (kept, FiniteFlag(averaged))
            return averaged

        fut = run_in_worker(self.comm, bucket.buffer(), work, key=bucket.index()).then(verdict)
        if bucket.is_last():
            self.comm.iteration += 1  # the step the stall watch names (counted as aiak's allreduce hook counts it)
        return fut

    def _average(self, buffer: torch.Tensor) -> None:
        buffer.div_(self.comm.world_size)
        sum_now(self.comm, buffer)

    def _compress(self, index: int, gradients: List[torch.Tensor], buffer: torch.Tensor) -> None:
        """Bucket ``index`` (``buffer``, holding ``gradients``) replaced by the average over the ranks of its
        rank-r approximation, with error feedback: torch's ``powerSGD_hook`` (warm start on), its uncompressed
        tensors summed together with the Ps."""
        s, world = self.torch_state, self.comm.world_size
        if index in s.error_dict:  # (none yet: nothing to add, and the residual is made below)
            buffer.add_(s.error_dict[index])
        with_feedback = self._spare.pop(index, None)  # reused: a fresh 4-bytes-a-value tensor per step costs
        if with_feedback is None or with_feedback.shape != buffer.shape:  # as much as the arithmetic (page faults)
            with_feedback = torch.empty_like(buffer)
        with_feedback.copy_(buffer)
        matrices, others = [], []
        for g in gradients:
            matrix = g.view(g.shape[0], -1) if g.dim() > 0 else g.view(1, 1)
            r = min(*matrix.shape, s.matrix_approximation_rank)
            (matrices if g.dim() > 1 and _should_compress(*matrix.shape, r, s.min_compression_rate)[0]
             else others).append(matrix)
        ranks = [min(*m.shape, s.matrix_approximation_rank) for m in matrices]
        fresh = index not in s.p_memory_dict
        if fresh:
            s.p_memory_dict[index] = buffer.new_empty(sum(m.shape[0] * r for m, r in zip(matrices, ranks)))
            s.q_memory_dict[index] = buffer.new_empty(sum(m.shape[1] * r for m, r in zip(matrices, ranks)))
        ps = _views(s.p_memory_dict[index], [(m.shape[0], r) for m, r in zip(matrices, ranks)])
        qs = _views(s.q_memory_dict[index], [(m.shape[1], r) for m, r in zip(matrices, ranks)])
        if fresh:  # torch's random start: one seed drawn from the state's generator, a normal Q per matrix
            generator = torch.Generator().manual_seed(s.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=generator, dtype=buffer.dtype))
        for q in qs:
            _orthogonalize(q, s.orthogonalization_epsilon)
        for m, q, p in zip(matrices, qs, ps):
            torch.bmm(m.unsqueeze(0), q, out=p)

        # one sum: the uncompressed tensors, then the Ps (the Ps are not divided: they are orthogonalized next)
        wire = torch.cat([t.reshape(-1) for t in others] + [s.p_memory_dict[index]])
        sum_now(self.comm, wire)
        uncompressed = sum(t.numel() for t in others)
        copy_into(others, wire[:uncompressed].div_(world))
        s.p_memory_dict[index].copy_(wire[uncompressed:])
        for p in ps:
            _orthogonalize(p, s.orthogonalization_epsilon)
        for m, p, q in zip(matrices, ps, qs):
            torch.bmm(m.unsqueeze(0).transpose(1, 2), p, out=q)

        sum_now(self.comm, s.q_memory_dict[index])
        s.q_memory_dict[index].div_(world)
        for m, p, q in zip(matrices, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=m.unsqueeze(0))
        s.error_dict[index] = with_feedback.sub_(buffer)  # not the kept residual's memory: that stays as it was

    def _keep(self, index: int) -> _Kept:
        """What the hook may change of bucket ``index``: the residual (replaced, never written into) and P, Q
        (written into)."""
        s = self.torch_state
        p, q = s.p_memory_dict.get(index), s.q_memory_dict.get(index)
        return s.error_dict.get(index), None if p is None else p.clone(), None if q is None else q.clone()

    def _settle(self, index: Optional[int] = None) -> None:
        """Read the verdicts on earlier calls (of bucket ``index``, or all): a non-finite one puts back its state."""
        s = self.torch_state
        for i in [index] if index is not None else list(self._pending):
            pending = self._pending.pop(i, None)
            if pending is None:
                continue
            if bool(pending[1]):  # the residual it replaced is free memory for the bucket's next residual
                if pending[0][0] is not None and pending[0][0] is not s.error_dict.get(i):
                    self._spare[i] = pending[0][0]
                continue
            self.skipped += 1
            if s.error_dict.get(i) is not None and s.error_dict[i] is not pending[0][0]:
                self._spare[i] = s.error_dict[i]
            for table, value in zip((s.error_dict, s.p_memory_dict, s.q_memory_dict), pending[0]):
                if value is None:
                    table.pop(i, None)
                else:
                    table[i] = value

    def _forget(self, index: int) -> None:
        s = self.torch_state
        for table in (s.error_dict, s.p_memory_dict, s.q_memory_dict):
            table.pop(index, None)

    def residuals(self) -> Dict[int, torch.Tensor]:
        """Copies of the residuals the next step adds, by bucket index (tests and debugging)."""
        self._settle()
        return {i: r.clone() for i, r in self.torch_state.error_dict.items()}

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        self._settle()
        s = self.torch_state
        return {"algorithm": "powersgd", "rank": dist.get_rank(), "iter": s.iter, "rng": _rng_state(s.rng),
                "layouts": self.buckets.state_dict(),
                "error": {i: t.clone() for i, t in s.error_dict.items()},
                "p": {i: t.clone() for i, t in s.p_memory_dict.items()},
                "q": {i: t.clone() for i, t in s.q_memory_dict.items()}, "skipped": self.skipped}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_saved(state)
        self._pending.clear()
        s = self.torch_state
        s.iter = int(state["iter"])
        _set_rng_state(s.rng, state["rng"])
        self.buckets.load_state_dict(state["layouts"])
        self.skipped = int(state.get("skipped", 0))
        s.error_dict = {i: t.clone() for i, t in state["error"].items()}
        if s.error_dict and another_ranks(state, "PowerSGD residuals"):
            s.error_dict = {}
        s.p_memory_dict = {i: t.clone() for i, t in state["p"].items()}
        s.q_memory_dict = {i: t.clone() for i, t in state["q"].items()}

    def describe(self) -> str:
        topology = "hierarchical" if self.comm.hierarchical else "flat"
        return f"PowerSGD: rank {self.rank}, warm-up {self.warmup_steps} steps, {topology} sums"


def _rng_state(rng) -> Dict[str, Any]:
    """``numpy.random.RandomState.get_state()`` (PowerSGD's generator) as tensors and numbers: what ``torch.load``
    reads with its default ``weights_only=True`` (a numpy array is refused there)."""
    name, key, position, has_gauss, gauss = rng.get_state()
    return {"name": name, "key": torch.from_numpy(key.astype("int64")), "position": int(position),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_rng_state(rng, state) -> None:
    if isinstance(state, tuple):  # a checkpoint from before: numpy's own tuple
        rng.set_state(state)
        return
    rng.set_state((state["name"], state["key"].numpy().astype("uint32"), state["position"], state["has_gauss"],
                   state["gauss"]))


def _views(memory: torch.Tensor, shapes: List[Tuple[int, int]]) -> List[torch.Tensor]:
    """``memory`` cut into consecutive ``(1, rows, r)`` views, one per shape (torch's layout of Ps and Qs)."""
    views, offset = [], 0
    for rows, r in shapes:
        views.append(memory[offset:offset + rows * r].view(1, rows, r))
        offset += rows * r
    return views


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: `PowerSGD.hook` (DDP takes a state and a function)."""
    # (annotations are real objects here, no ``from __future__ import annotations``: DDP checks them)
    return state.hook(bucket)
