"""DDP communication hooks: flat or hierarchical allreduce, optionally compressed.

Contract (torch/distributed/algorithms/ddp_comm_hooks): ``hook(state, bucket) -> Future[Tensor]``.
One hook, `comm_hook`, reads its algorithm from `CommState` at every bucket, so the
autotuner can switch algorithms between steps on the same DDP object (a DDP accepts one hook only).

How a bucket is processed. The hook divides the bucket by the world size and hands it to the state's worker,
one daemon thread that runs each bucket's stages as straight-line code, bucket after bucket in the order the
hook received them (DDP launches buckets in index order on every rank), so every process group sees its
collectives in the same order on every rank. Each collective is issued with ``async_op=True`` and waited
(``work.wait()``) right where its result is read: on gloo that blocks the worker thread, not the autograd thread; on
NCCL it makes the worker's current CUDA stream wait for the collective, which is exactly the dependency the next stage
needs. On CUDA the hook records an event on the caller's current stream; the worker runs on its own comm stream, which
first waits for that event, and completes the returned future (``devices=[device]``) from that stream, so
DDP's wait on the future orders everything after it behind the last stage.

Hierarchical allreduce (two-level, as used for Swin over 25 Gb/s TCP): intra-node reduce-scatter, then
an inter-node allreduce of each shard (local rank ``i`` of every node carries shard ``i``: all local ranks
use the network in parallel, each with ``1/local_size`` of the bucket), then an intra-node allgather.
Buckets are cut into chunks (``pipeline_mb``) and the stages are software-pipelined: while chunk ``k``
crosses the network, chunk ``k+1`` is reduce-scattered and chunk ``k-1`` allgathered on the node.
CPU-Reduce (ACSpeed's, for GPUs that share PCIe with the NIC): the inter-node allreduce of each shard runs on host
copies over a gloo group (``host_inter``) instead of NCCL: the shard is cast to the wire dtype on the GPU, copied
into pinned host memory on the comm stream, summed by gloo across nodes, and copied back before the allgather
(Horovod's hierarchical allreduce with CPU operations). Only the stage that crosses nodes moves to the host; the
node's reduce-scatter and allgather stay on NCCL.
Compression wraps the inter-node step only by default (``compress_intra=False``): that is where the
bandwidth is scarce. int8 is Bagua's ByteGrad: reduce-scatter in compressed form (all-to-all of
quantized chunks), decompress and sum, compress the summed chunk, allgather; both quantizations keep an
error-feedback residual per bucket and chunk (`ErrorFeedback`); a bucket that
comes out non-finite (an fp16 overflow, which the loss scaler skips) leaves them as they were. The residuals
are tied to the bucket's layout (`bucket_layout`: which parameters, in which order), so when DDP rebuilds
its buckets after the first iteration they are dropped rather than added to other parameters.

Averaging matches DDP's default: divide by the world size before communicating (also keeps fp16 from
overflowing). Collectives are looked up in ``torch.distributed`` at call time, so the deadlock guard
(`aiak.comm.diagnostics.deadlock`), which replaces them there, sees every one.
"""
import contextlib
import functools
import queue
import threading
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist

from aiak.comm.allreduce.buckets import BucketRecord, Layout, ParameterNumbers, bucket_layout
from aiak.comm.allreduce.compression import (CAST_DTYPES, ErrorFeedback, FiniteFlag, check_compression, dequantize_int8,
                                   dequantize_int8_chunks, pad_to_multiple, quantize_int8, quantize_int8_chunks)
from aiak.comm.diagnostics.stall import STALL_WARN_S, StallWatch, next_watch_name
from aiak.comm.allreduce.topology import HierarchicalGroups
from aiak.util.background_threads import compute_on_one_thread, stop_at_exit
from aiak.util.warn import warn

Future = torch.futures.Future
SCOPES = ("world", "node", "rank")  # over which ranks `average` averages (`CommState.scope`)
IDLE_EXIT_S = 5.0  # a worker thread without work for this long exits; the next bucket starts a new one
EXIT_JOIN_S = 10.0  # at interpreter exit, how long to wait for a job in flight (a hung peer must not hang exit)
_STOP = object()  # put in a worker's queue at interpreter exit


# -- collectives on 1-D tensors ------------------------------------------------------------------------
class _Issued:
    """A collective in flight. ``wait()`` waits for it, then runs ``then`` (local work on its output).

    Issued inside the comm worker's job for a bucket, it is numbered by that state's
    `StallWatch` (the job's, in `_job`), which is told while the worker waits
    in it: a wait past ``comm.stall_warn_s`` is reported with the ranks that have not reached it."""

    __slots__ = ("work", "then", "watch", "where")

    def __init__(self, work, then: Optional[Callable[[], object]] = None, stage: str = "", group=None):
        self.work, self.then = work, then
        self.watch = getattr(_job, "watch", None)
        self.where = self.watch.issued(stage, group) if self.watch is not None else None

    def wait(self) -> None:
        if self.watch is None:
            self.work.wait()
        else:
            self.watch.waiting_in(self.where)
            try:
                self.work.wait()
            finally:
                self.watch.waiting_in(None)
        if self.then is not None:
            self.then()


_job = threading.local()  # ``watch``: the StallWatch of the bucket the comm worker runs now (set by _run_bucket)


def _dist(name: str, deprecated: str) -> Callable:
    """``dist.<name>``, or the older ``dist.<deprecated>`` on a torch that lacks it (looked up per call)."""
    return getattr(dist, name, None) or getattr(dist, deprecated)


def _allreduce(x: torch.Tensor, group, wire: torch.dtype, stage: str = "allreduce") -> _Issued:
    """Sum of ``x`` over ``group``, into ``x``, sent as ``wire`` (a sum past fp16's range is made again: see
    `_overflowed`)."""
    if x.dtype == wire:
        return _Issued(dist.all_reduce(x, group=group, async_op=True), stage=stage, group=group)
    sent = x.to(wire)
    return _Issued(dist.all_reduce(sent, group=group, async_op=True),
                   functools.partial(_take_sum, x, sent, group, stage), stage, group)


def _overflowed(sent: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether the sum of ``sent``, cast to fp16 by aiak from the wider ``source``, came out inf or NaN.

    fp16 holds magnitudes up to 65504: a gradient, a BatchNorm variance of raw features or a change of it past that
    becomes inf in the cast (or in the sum), and inf, then NaN, in every weight or buffer it reaches. Every rank holds
    the same sum, so every rank gets the same answer here and makes the same sum again in ``source``'s own dtype: no
    collective is added while values fit, and one (that sum again) when they do not. The check is one reduction over
    the fp16 sum (`FiniteFlag`); on CUDA the worker waits for it. A non-finite
    value the model produced itself (an fp16 overflow the loss scaler will skip) is summed again too, and stays
    non-finite."""
    return sent.dtype is torch.float16 and source.dtype is not torch.float16 and not bool(FiniteFlag(sent))


def _sum_again(x: torch.Tensor, group, stage: str) -> None:
    """The sum of ``x`` over ``group`` in ``x``'s own dtype, now (after an fp16 sum overflowed)."""
    _Issued(dist.all_reduce(x, group=group, async_op=True), stage=f"{stage}, again in {x.dtype} (past fp16's range)",
            group=group).wait()


def _take_sum(x: torch.Tensor, sent: torch.Tensor, group, stage: str) -> None:
    """``x`` = the sum that arrived in ``sent`` (``x`` cast for the wire), or, past fp16's range, ``x`` summed
    again as it is."""
    if _overflowed(sent, x):
        _sum_again(x, group, stage)
    else:
        x.copy_(sent)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, stage: str = "reduce-scatter") -> _Issued:
    """``output`` = this rank's chunk of the sum of ``input`` over ``group``.

    Gloo has no reduce-scatter: there it is an all-to-all of the chunks and a local sum (same bytes on the wire).
    """
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(input)
        work = dist.all_to_all_single(received, input, group=group, async_op=True)
        return _Issued(work, functools.partial(torch.sum, received.view(-1, output.numel()), 0, out=output), stage,
                       group)
    return _Issued(_dist("reduce_scatter_single", "reduce_scatter_tensor")(output, input, group=group,
                                                                           async_op=True), stage=stage, group=group)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group, stage: str = "allgather") -> _Issued:
    return _Issued(_dist("all_gather_single", "all_gather_into_tensor")(output, input, group=group, async_op=True),
                   stage=stage, group=group)


class _Together:
    """Collectives issued together (one per connection); ``wait()`` waits for each in turn."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[_Issued]):
        self.parts = parts

    def wait(self) -> None:
        for part in self.parts:
            part.wait()


def _pieces(x: torch.Tensor, k: int) -> List[torch.Tensor]:
    """``x`` (1-D) cut into ``k`` contiguous views of nearly equal size (fewer when ``x`` has fewer values)."""
    n = x.numel()
    bounds = [n * i // k for i in range(k + 1)]
    return [x[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] or [x]


def _allreduce_over(x: torch.Tensor, group, wire: torch.dtype, connections: int, stage: str):
    """`_allreduce` of ``x`` cut into one piece per connection, all issued at once (on a group of
    ``connections`` gloo contexts each piece travels on its own TCP connection: `aiak.comm.allreduce.connections`)."""
    if connections == 1:
        return _allreduce(x, group, wire, stage)
    return _Together([_allreduce(piece, group, wire, f"{stage}, piece {i} of {connections}")
                      for i, piece in enumerate(_pieces(x, connections))])


class _Int8Allreduce:
    """ByteGrad sum of a 1-D ``x`` over ``group``, in place, in three steps a pipeline can interleave.

    `exchange`: add the residual, quantize ``size`` chunks, all-to-all (the reduce-scatter, compressed);
    `share`: decode and sum the chunks this rank received, add the residual, re-quantize, allgather;
    `finish`: decode the gathered chunks into ``x``.
    Each step after the first needs the previous step's collective waited. The caller commits the residuals of
    `keys` once the whole bucket is known finite (or not): a non-finite bucket keeps the old residuals.
    """

    __slots__ = ("x", "group", "size", "block", "feedback", "keys", "layout", "n", "chunk", "received", "gathered",
                 "stage")

    def __init__(self, x: torch.Tensor, group, feedback: ErrorFeedback, key, block: int, layout: Optional[Hashable],
                 stage: str = "allreduce"):
        self.x, self.group, self.feedback, self.block, self.stage = x, group, feedback, block, stage
        self.size = dist.get_world_size(group)
        self.keys = ((key, "local"), (key, "shard"))
        self.layout = layout  # what ``x`` holds (`bucket_layout`); the residuals are kept per layout

    def exchange(self) -> _Issued:
        padded, self.n = pad_to_multiple(self.x, self.size * self.block)
        self.chunk = padded.numel() // self.size
        sent = self.feedback.add(self.keys[0], padded, self.layout)
        packed = quantize_int8_chunks(sent, self.size, self.block)
        if self.feedback.enabled:
            self.feedback.update(self.keys[0], sent, dequantize_int8_chunks(packed, self.chunk, self.block))
        self.received = torch.empty_like(packed)
        return _Issued(dist.all_to_all_single(self.received, packed, group=self.group, async_op=True),
                       stage=f"{self.stage} (int8 all-to-all)", group=self.group)

    def share(self) -> _Issued:
        total = dequantize_int8_chunks(self.received, self.chunk, self.block).view(self.size, self.chunk).sum(0)
        sent = self.feedback.add(self.keys[1], total, self.layout)
        mine = quantize_int8(sent, self.block)
        if self.feedback.enabled:
            self.feedback.update(self.keys[1], sent, dequantize_int8(mine, self.chunk, self.block))
        self.gathered = torch.empty(self.size * mine.numel(), dtype=torch.uint8, device=self.x.device)
        return _all_gather(self.gathered, mine, self.group, f"{self.stage} (int8 allgather)")

    def finish(self) -> None:
        if self.n == self.size * self.chunk:  # no padding: decode straight into ``x``
            dequantize_int8_chunks(self.gathered, self.chunk, self.block, out=self.x)
        else:
            self.x.copy_(dequantize_int8_chunks(self.gathered, self.chunk, self.block)[:self.n])


class _Int8Over:
    """`_Int8Allreduce` of ``x`` cut into one piece per connection, each step issued for all pieces at
    once; with one connection it is exactly one `_Int8Allreduce` under ``key``."""

    __slots__ = ("parts", "keys")

    def __init__(self, x: torch.Tensor, group, feedback: ErrorFeedback, key, block: int, layout: Optional[Hashable],
                 stage: str, connections: int):
        pieces = _pieces(x, connections) if connections > 1 else [x]
        self.parts = [_Int8Allreduce(piece, group, feedback, key if len(pieces) == 1 else (key, "piece", i), block,
                                     layout, stage if len(pieces) == 1 else f"{stage}, piece {i} of {len(pieces)}")
                      for i, piece in enumerate(pieces)]
        self.keys = tuple(k for part in self.parts for k in part.keys)

    def exchange(self) -> _Together:
        return _Together([part.exchange() for part in self.parts])

    def share(self) -> _Together:
        return _Together([part.share() for part in self.parts])

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


# -- state -------------------------------------------------------------------------------------------
class CommState:
    """What `comm_hook` does, switchable between steps.

    Args:
        process_group: the flat group (DDP's; ``None`` = world).
        groups: intra/inter groups from `aiak.comm.allreduce.topology.build_groups`; ``None`` = flat only.
        hierarchical: run the two-level algorithm (needs ``groups``).
        compression: ``none | fp16 | bf16 | int8``.
        compress_intra: also compress the intra-node reduce-scatter/allgather (fp16/bf16 only).
        int8_block: values per int8 block (one min/scale pair each).
        pipeline_mb: chunk size of the hierarchical pipeline (float32 MB); ``0`` = one chunk per bucket.
        error_feedback: keep int8 residuals (turning it off is for experiments only).
        stall_warn_s: a collective waiting this long names the ranks that have not reached it
            (`aiak.comm.diagnostics.stall`); 0 = off.
        wide: groups whose collectives spread over several TCP connections per peer
            (`aiak.comm.allreduce.connections.group_with_connections`), keyed ``("flat" | "inter", connections)``:
            copies of ``process_group`` and of ``groups.inter``.
        connections: how many connections the cross-node stage uses (1: the plain groups).
        host_inter: a gloo group of this rank's inter-node ranks (``groups.inter_ranks``), for CPU-Reduce: the
            cross-node stage of the hierarchical algorithm on host copies of the shards. ``None``: unavailable.
        cpu_reduce: start with CPU-Reduce (needs ``hierarchical`` and ``host_inter``).
        local_size: ranks per node (the ``node`` scope averages over this many).

    ``scope`` says over which ranks the hook averages a bucket: ``world`` (every rank, with the algorithm above),
    ``node`` (this rank's node only: an allreduce in ``groups.intra``, nothing at all with one rank per node; local
    SGD between its averages, `aiak.comm.algorithms.local_sgd`) or ``rank`` (no communication: each rank keeps its
    own gradient; decentralized SGD, `aiak.comm.algorithms.decentralized`).
    """

    __slots__ = ("process_group", "world_size", "groups", "hierarchical", "compression", "compress_intra",
                 "int8_block", "pipeline_mb", "feedback", "parameter_numbers", "buckets", "tuner", "iteration",
                 "worker", "watch", "wide", "connections", "host_inter", "cpu_reduce", "tuning", "scope", "local_size")

    def __init__(self, process_group=None, groups: Optional[HierarchicalGroups] = None, hierarchical: bool = False,
                 compression: str = "none", compress_intra: bool = False, int8_block: int = 2048,
                 pipeline_mb: float = 2.0, error_feedback: bool = True, stall_warn_s: float = STALL_WARN_S,
                 wide: Optional[Dict[Tuple[str, int], object]] = None, connections: int = 1, host_inter=None,
                 cpu_reduce: bool = False, local_size: int = 1):
        if hierarchical and groups is None:
            raise ValueError("hierarchical=True needs groups (aiak.comm.allreduce.topology.build_groups); it returns "
                             "None for uneven nodes, in which case pass hierarchical=False")
        if int8_block < 1:
            raise ValueError(f"int8_block must be >= 1, got {int8_block}")
        if pipeline_mb < 0:
            raise ValueError(f"pipeline_mb must be >= 0 (0 = no pipelining), got {pipeline_mb}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.groups = groups
        self.hierarchical, self.compression, self.connections, self.cpu_reduce = False, "none", 1, False
        self.compress_intra = compress_intra
        self.int8_block = int8_block
        self.pipeline_mb = pipeline_mb
        self.feedback = ErrorFeedback(error_feedback)
        self.parameter_numbers = ParameterNumbers()  # names the parameters in a bucket's layout (number() the model)
        self.buckets = BucketRecord()  # the layout of each bucket the int8 residuals were computed on
        self.tuner = None  # an aiak.comm.allreduce.autotune.StepTuner while tuning
        self.tuning = None  # an aiak.comm.allreduce.autotune.CommTuning: what the autotuner measured and chose
        self.iteration = 0
        self.worker = _Worker()
        self.watch = StallWatch(stall_warn_s, next_watch_name())
        self.wide = dict(wide or {})
        self.host_inter = host_inter
        self.local_size = local_size
        self.scope = "world"
        self.set_route(hierarchical, compression, connections, cpu_reduce)

    def scope_size(self) -> int:
        """How many ranks a bucket is averaged over under ``scope``."""
        return self.world_size if self.scope == "world" else self.local_size if self.scope == "node" else 1

    def sum_items(self, x: torch.Tensor) -> None:
        """Sum the small ``x`` in place, exactly (its own dtype, one plain allreduce), over the ranks of ``scope``,
        and wait for it: the step controller's counted items of a window (`aiak.step.window_items`). It runs
        on the hook's worker, after the buckets queued there, under the stall watch."""
        if self.scope_size() == 1:
            return
        group = self.process_group if self.scope == "world" else self.groups.intra
        run_in_worker(self, x, functools.partial(_sum_plainly, group=group), key="the window's item count").wait()

    def set_scope(self, scope: str) -> None:
        """Average buckets over ``world``, ``node`` or ``rank`` (see the class); call it between steps."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if scope == "node" and self.local_size > 1 and self.groups is None:
            raise ValueError("the node scope needs the intra-node groups (aiak.comm.allreduce.topology.build_groups)")
        self.scope = scope

    def set_route(self, hierarchical: bool, compression: str, connections: int = 1,
                      cpu_reduce: bool = False) -> None:
        """Switch the route buckets travel (the allreduce algorithm: flat or hierarchical, compression, connections,
        CPU-Reduce); call it between steps (no bucket in flight), as the tuner does at bucket 0."""
        if hierarchical and self.groups is None:
            raise ValueError("hierarchical allreduce is unavailable (single node, one rank per node or uneven nodes)")
        if connections != 1 and ("inter" if hierarchical else "flat", connections) not in self.wide:
            raise ValueError(f"{connections} connections per peer were not set up for the "
                             f"{'hierarchical' if hierarchical else 'flat'} algorithm (comm.connections)")
        if cpu_reduce and not (hierarchical and self.host_inter is not None and connections == 1):
            raise ValueError("CPU-Reduce is the hierarchical algorithm with its cross-node stage on a gloo group of host "
                             "copies, over one connection: it needs hierarchical=True, a host_inter group and "
                             f"connections=1 (got hierarchical={hierarchical}, host_inter "
                             f"{'set' if self.host_inter is not None else 'None'}, connections={connections})")
        if (hierarchical, compression, connections, cpu_reduce) != self.route:
            self.feedback.reset()
        self.hierarchical, self.compression = hierarchical, check_compression(compression)
        self.connections, self.cpu_reduce = connections, bool(cpu_reduce)

    @property
    def route(self) -> Tuple[bool, str, int, bool]:
        """``(hierarchical, compression, connections, cpu_reduce)``, as `set_route` takes them."""
        return self.hierarchical, self.compression, self.connections, self.cpu_reduce

    def cross_group(self, kind: str, connections: int):
        """The group of the stage that crosses nodes: ``kind`` "flat" (DDP's group) or "inter" (this rank's
        inter-node group), with ``connections`` TCP connections per peer."""
        if connections != 1:
            return self.wide[(kind, connections)]
        return self.process_group if kind == "flat" else self.groups.inter

    def describe(self) -> str:
        return describe_route(*self.route)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        """What the hook carries from one step to the next, for a checkpoint (call it with no bucket in flight):
        this rank's int8 error-feedback residuals with the layout of the bucket each belongs to
        (`BucketRecord`), and what they were computed under (rank, algorithm, ranks,
        block and chunk sizes). Everything else in the state is settings or is rebuilt the same way."""
        # ("algorithm": the route, under the key checkpoints have always had)
        return {"rank": dist.get_rank(), "algorithm": self.route, "world_size": self.world_size,
                "local_size": self.local_size, "int8_block": self.int8_block, "pipeline_mb": self.pipeline_mb,
                "iteration": self.iteration, "layouts": self.buckets.state_dict(),
                "residuals": self.feedback.state_dict()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Take back `state_dict`'s residuals, to be added on the next steps as the saved run would have:
        the first step after this runs the recorded buckets. Residuals of another rank (a checkpoint saved by one
        rank and loaded by all) or of another algorithm or topology mean nothing here: they are dropped, saying
        why, and the next steps quantize afresh."""
        self.iteration = int(state.get("iteration", 0))
        self.feedback.reset()
        self.buckets = BucketRecord()
        residuals = state.get("residuals") or {}
        if not residuals:
            return
        saved = (tuple(state["algorithm"]), state["world_size"], state["local_size"], state["int8_block"],
                 state["pipeline_mb"])
        here = (self.route, self.world_size, self.local_size, self.int8_block, self.pipeline_mb)
        if another_ranks(state, "int8 error-feedback residuals"):
            return
        if saved != here:
            warn(f"aiak.comm: this checkpoint's int8 error-feedback residuals were computed with "
                 f"{describe_route(*saved[0])} on {saved[1]} ranks ({saved[2]} per node), int8 blocks of "
                 f"{saved[3]}, chunks of {saved[4]:g} MB; this run has {self.describe()} on {here[1]} ranks ({here[2]} "
                 f"per node), {here[3]}, {here[4]:g} MB. They are dropped: the next steps quantize afresh, and the run "
                 "is no longer the one the checkpoint continued", everywhere=True)
            return
        self.feedback.load_state_dict(residuals)
        self.buckets.load_state_dict(state["layouts"])


def another_ranks(state: Dict[str, object], what: str) -> bool:
    """Whether ``state`` (a comm state's ``state_dict()``) was saved by another rank than this one, saying so on this
    rank: ``what`` (residuals: each rank's own compression error) then means nothing here and is dropped. A
    checkpoint saved by one rank and loaded by all does this."""
    saved = state.get("rank", dist.get_rank())
    if saved == dist.get_rank():
        return False
    warn(f"aiak.comm: this checkpoint's {what} are rank {saved}'s, and this is rank {dist.get_rank()}: each rank's "
         f"{what} are its own compression error, so save a checkpoint per rank (the optimizer's state_dict() on every "
         "rank). They are dropped here, and the run is no longer the one the checkpoint continued", everywhere=True)
    return True


def describe_route(hierarchical: bool, compression: str, connections: int = 1, cpu_reduce: bool = False) -> str:
    """``hierarchical (CPU-Reduce)+fp16, 4 connections``: a route as `CommState.set_route` takes it."""
    algo = ("hierarchical (CPU-Reduce)" if cpu_reduce else "hierarchical") if hierarchical else "flat"
    algo = algo if compression == "none" else f"{algo}+{compression}"
    return algo if connections == 1 else f"{algo}, {connections} connections"


# -- the algorithms, each run by the worker on one bucket (already divided by the world size) ----------------
def _flat(state: CommState, compression: str, connections: int, x: torch.Tensor, key,
          layout: Optional[Hashable]) -> None:
    group = state.cross_group("flat", connections)
    if compression == "int8":
        op = _Int8Over(x, group, state.feedback, key, state.int8_block, layout, "allreduce", connections)
        op.exchange().wait()
        op.share().wait()
        op.finish()
        state.feedback.commit(op.keys, FiniteFlag(x))  # the same verdict on every rank: all hold the same ``x``
    else:
        _allreduce_over(x, group, CAST_DTYPES.get(compression, x.dtype), connections, "allreduce").wait()


class _Chunk:
    """One slice of a bucket in the hierarchical pipeline."""

    __slots__ = ("index", "values", "shard", "host", "inflight", "int8")

    def __init__(self, index: int, values: torch.Tensor, local_size: int):
        self.index = index
        self.values = values  # the slice of the (padded, maybe cast) bucket; the allgather writes it back
        self.shard = torch.empty(values.numel() // local_size, dtype=values.dtype, device=values.device)
        self.host: Optional[torch.Tensor] = None  # CPU-Reduce: the host copy of ``shard`` that crosses the nodes
        self.inflight = None  # the collective(s) the next stage of this chunk waits for: _Issued or _Together
        self.int8: Optional[_Int8Over] = None


def _host_copy(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``shard`` in host memory as ``dtype``, complete when this returns (gloo reads it from its own
    threads). From a GPU: cast there (fewer bytes over PCIe), copied into pinned memory on the current stream (the
    comm stream, already ordered after the reduce-scatter), and that copy waited for; the event, not the stream, so
    the next chunk's reduce-scatter keeps running meanwhile."""
    if not shard.is_cuda:
        return shard.to(dtype, copy=True)
    host = torch.empty(shard.shape, dtype=dtype, pin_memory=True)
    host.copy_(shard.to(dtype), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    return host


def _chunk_bounds(numel: int, local_size: int, pipeline_mb: float, compression: str) -> List[Tuple[int, int]]:
    """Chunks of ``pipeline_mb`` of float32 values (int8: twice as many values), multiples of ``local_size``.

    Each int8 chunk pays two collectives and several quantize passes: too small a chunk pays them too often,
    too large a one leaves little to overlap. benchmarks/comm_netns.py (2 nodes x 2 ranks, 500 Mbit/s),
    hierarchical+int8 vs flat, values per chunk 0.5M / 1M / 2M: 16 MB 3.56x / 4.28x / 3.74-4.01x,
    64 MB 3.79x / 4.87x / 4.21x.
    """
    if pipeline_mb == 0:
        return [(0, numel)]
    bytes_per_value = 2 if compression == "int8" else 4
    per_chunk = max(local_size, int(pipeline_mb * 2**20 / bytes_per_value) // local_size * local_size)
    return [(a, min(a + per_chunk, numel)) for a in range(0, numel, per_chunk)]


class _Hierarchical:
    """Intra-node reduce-scatter -> inter-node allreduce of this rank's shard -> intra-node allgather, chunk by chunk.

    Each stage is a method taking a chunk: it waits for what the previous stage issued for that chunk, works on
    the result and issues the chunk's next collective. `run` is the software pipeline.
    """

    def __init__(self, state: CommState, compression: str, connections: int, cpu_reduce: bool, x: torch.Tensor, key,
                 layout: Optional[Hashable]):
        self.state, self.compression, self.x, self.key, self.layout = state, compression, x, key, layout
        self.connections, self.cpu_reduce = connections, cpu_reduce
        self.intra = state.groups.intra
        self.inter = state.host_inter if cpu_reduce else state.cross_group("inter", connections)
        local = len(state.groups.intra_ranks)
        self.padded, self.n = pad_to_multiple(x, local)
        intra_dtype = CAST_DTYPES.get(compression) if state.compress_intra else None
        self.send = self.padded.to(intra_dtype) if intra_dtype is not None else self.padded
        bounds = _chunk_bounds(self.padded.numel(), local, state.pipeline_mb, compression)
        self.chunks = [_Chunk(i, self.send[a:b], local) for i, (a, b) in enumerate(bounds)]
        self.int8_keys: List[tuple] = []  # residuals to commit once the whole bucket is known finite or not

    def run(self) -> None:
        if self.compression == "int8":
            stages = [self.scatter_in_node, self.exchange_across_nodes, self.share_across_nodes, self.gather_in_node]
        else:
            stages = [self.scatter_in_node, self.cross_nodes, self.gather_in_node]
        # At tick t stage s works on chunk t - s: chunk t is reduce-scattered while chunk t-1 crosses the nodes and
        # chunk t-2 is allgathered. The newest chunk goes first, so a stage that waits has the others in flight.
        for tick in range(len(self.chunks) + len(stages) - 1):
            for depth, stage in enumerate(stages):
                if 0 <= tick - depth < len(self.chunks):
                    stage(self.chunks[tick - depth])
        for chunk in self.chunks:
            chunk.inflight.wait()  # the allgathers
        if self.send.data_ptr() != self.x.data_ptr():
            if self.send is not self.padded and _overflowed(self.send, self.padded):  # compress_intra's fp16
                _Hierarchical(self.state, "none", self.connections, self.cpu_reduce, self.x, None, None).run()
                return
            self.x.copy_(self.send[:self.n])
        if self.compression == "int8":  # every rank holds the same bucket now: the same verdict everywhere
            self.state.feedback.commit(self.int8_keys, FiniteFlag(self.x))

    def scatter_in_node(self, chunk: _Chunk) -> None:
        chunk.inflight = _reduce_scatter(chunk.shard, chunk.values, self.intra,
                                         f"reduce-scatter in node, chunk {chunk.index}")

    def crossing(self, chunk: _Chunk, dtype: torch.dtype) -> torch.Tensor:
        """The tensor that crosses the nodes: the shard itself, or (CPU-Reduce) its host copy as ``dtype``."""
        if not self.cpu_reduce:
            return chunk.shard
        chunk.host = _host_copy(chunk.shard, dtype)
        return chunk.host

    def cross_nodes(self, chunk: _Chunk) -> None:
        chunk.inflight.wait()
        wire = CAST_DTYPES.get(self.compression, chunk.shard.dtype)  # uncompressed: the bucket's dtype, as DDP
        chunk.inflight = _allreduce_over(self.crossing(chunk, wire), self.inter, wire, self.connections,
                                         f"allreduce across nodes{' on the host' if self.cpu_reduce else ''}, "
                                         f"chunk {chunk.index}")

    def exchange_across_nodes(self, chunk: _Chunk) -> None:
        chunk.inflight.wait()
        chunk.int8 = _Int8Over(self.crossing(chunk, chunk.shard.dtype), self.inter, self.state.feedback, (self.key, chunk.index),
                               self.state.int8_block, self.layout, f"allreduce across nodes, chunk {chunk.index}",
                               self.connections)
        chunk.inflight = chunk.int8.exchange()

    def share_across_nodes(self, chunk: _Chunk) -> None:
        chunk.inflight.wait()
        chunk.inflight = chunk.int8.share()

    def gather_in_node(self, chunk: _Chunk) -> None:
        chunk.inflight.wait()
        if chunk.int8 is not None:
            chunk.int8.finish()
            self.int8_keys.extend(chunk.int8.keys)
            chunk.int8 = None
        if chunk.host is not None:  # CPU-Reduce: back to the device, on the stream the allgather is issued from
            if _overflowed(chunk.host, chunk.shard):  # cast to fp16 on its way to the host
                chunk.host = _host_copy(chunk.shard, chunk.shard.dtype)
                _sum_again(chunk.host, self.inter, f"allreduce across nodes on the host, chunk {chunk.index}")
            chunk.shard.copy_(chunk.host, non_blocking=True)
            chunk.host = None
        chunk.inflight = _all_gather(chunk.values, chunk.shard, self.intra, f"allgather in node, chunk {chunk.index}")


# -- the worker --------------------------------------------------------------------------------------
class _Worker:
    """One daemon thread that runs jobs in submission order, and the CUDA comm stream of each device it uses.

    The thread starts with the first job and exits after ``IDLE_EXIT_S`` without one (the next job starts a new
    thread), so states that are dropped leave no thread behind. At interpreter exit it finishes the job in
    flight and stops before Python finalizes (see ``aiak.util.background_threads``: a daemon thread still returning
    from a collective then would abort the process).
    """

    __slots__ = ("_jobs", "_lock", "_thread", "_streams", "__weakref__")

    def __init__(self):
        self._jobs: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._streams: Dict[torch.device, "torch.cuda.Stream"] = {}
        stop_at_exit(self)

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="aiak-comm", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        compute_on_one_thread()   # its casts and compression beside the step's compute (aiak.util.background_threads)
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # ``submit`` puts under the same lock: no job is left behind
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            if job is _STOP:
                with self._lock:
                    self._thread = None
                return
            job()

    def stop_for_exit(self) -> None:
        """Let the thread finish its jobs, then join it (at most ``EXIT_JOIN_S``)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._jobs.put(_STOP)
        thread.join(timeout=EXIT_JOIN_S)

    @contextlib.contextmanager
    def on_comm_stream(self, tensor: torch.Tensor, ready: Optional["torch.cuda.Event"]):
        """Make ``tensor``'s device and its comm stream current; the stream first waits for ``ready``."""
        if not tensor.is_cuda:
            yield
            return
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(device=tensor.device)
        with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            yield


def _in_node(state: CommState, x: torch.Tensor) -> None:
    """Sum ``x`` over this rank's node (the ``node`` scope), in the intra-node wire dtype of ``compress_intra``."""
    wire = CAST_DTYPES.get(state.compression, x.dtype) if state.compress_intra else x.dtype
    _allreduce(x, state.groups.intra, wire, "allreduce in node").wait()


def _run_bucket(state: CommState, route: Tuple[bool, str, int, bool], tensor: torch.Tensor, key, step: int,
                layout: Optional[Hashable], fut: Future, ready: Optional["torch.cuda.Event"],
                scope: str = "world") -> None:
    """The worker's job for one bucket of ``step``: sum ``tensor`` (already divided) in place, then complete or
    fail ``fut``."""
    _job.watch = state.watch if state.watch.enabled and not tensor.is_cuda else None  # see aiak.comm.diagnostics.stall
    if _job.watch is not None:
        _job.watch.at(step, key)
    hierarchical, compression, connections, cpu_reduce = route
    try:
        with state.worker.on_comm_stream(tensor, ready):
            if scope == "node":
                _in_node(state, tensor)
            elif hierarchical:
                _Hierarchical(state, compression, connections, cpu_reduce, tensor, key, layout).run()
            else:
                _flat(state, compression, connections, tensor, key, layout)
            fut.set_result(tensor)  # on CUDA: records the completion event on the comm stream
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        if not fut.done():
            fut.set_exception(e)


def _run_job(state: CommState, work: Callable[[torch.Tensor], None], tensor: torch.Tensor, fut: Future,
             ready: Optional["torch.cuda.Event"], key, step: int) -> None:
    _job.watch = state.watch if state.watch.enabled and not tensor.is_cuda else None  # as _run_bucket's
    if _job.watch is not None:
        _job.watch.at(step, key)
    try:
        with state.worker.on_comm_stream(tensor, ready):
            work(tensor)
            fut.set_result(tensor)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        if not fut.done():
            fut.set_exception(e)


def flat_copy(tensors: List[torch.Tensor]) -> torch.Tensor:
    """``tensors`` back to back in one new float32 vector (weights to average, `copy_into` puts them back)."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def copy_into(tensors: List[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` (from `flat_copy`) into ``tensors``, in place (their storage and ``.data`` stay theirs)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _sum_plainly(x: torch.Tensor, group) -> None:
    _allreduce(x, group, x.dtype, "sum of the window's items").wait()


def run_in_worker(state: CommState, tensor: torch.Tensor, work: Callable[[torch.Tensor], None],
                  key: Hashable = "job") -> Future:
    """``work(tensor)`` (collectives on ``tensor``, in place) on ``state``'s worker, after the work the caller's
    stream has queued on ``tensor``; resolves to ``tensor``. Returns at once: the caller computes meanwhile
    (decentralized SGD's exchange of weights runs beside the forward and backward this way). The stall watch
    covers its collectives as a bucket's (``key`` names the bucket in a warning, ``state.iteration`` when called the
    step): those issued through this module, and those ``work`` waits with `wait_watched`."""
    if tensor.is_cuda:
        fut, ready = Future(devices=[tensor.device]), torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))
    else:
        fut, ready = Future(), None
    state.worker.submit(functools.partial(_run_job, state, work, tensor, fut, ready, key, state.iteration))
    return fut


def wait_watched(work, stage: str, group=None) -> None:
    """Wait for ``work`` (a collective a job of `run_in_worker` issued itself, with ``async_op=True``) under
    the stall watch, as the collectives of this module are waited."""
    _Issued(work, stage=stage, group=group).wait()


def sum_now(state: CommState, x: torch.Tensor) -> None:
    """Sum the 1-D ``x`` in place over every rank, uncompressed, with ``state``'s topology (the hierarchical or the
    flat algorithm, one connection), waiting for the result: for a job of `run_in_worker` that computes
    between its collectives (PowerSGD's factors, `aiak.comm.algorithms.powersgd`)."""
    if state.hierarchical:
        _Hierarchical(state, "none", 1, False, x, key=None, layout=None).run()
    else:
        _flat(state, "none", 1, x, key=None, layout=None)


# -- the hook ----------------------------------------------------------------------------------------
def average(state: CommState, tensor: torch.Tensor, key=0, layout: Optional[Hashable] = None,
            scope: str = "world", step: Optional[int] = None) -> Future:
    """Average a 1-D tensor in place across the ranks of ``scope`` (`SCOPES`; ``world`` with ``state``'s
    algorithm); resolves to ``tensor``. ``step``: the step the stall watch names (by default ``state.iteration``, the
    synchronised backward passes so far: the step in progress).

    Returns at once; the state's worker does the work. Used by `comm_hook` and, outside DDP, by
    benchmarks and the comm-mode tuner. Every rank must average the same tensors in the same order.
    ``key`` names the tensor's int8 residuals; ``layout`` says what it holds (`bucket_layout`): a residual
    computed on another layout under the same key is dropped.
    """
    ranks = state.world_size if scope == "world" else state.local_size if scope == "node" else 1
    if scope != "world" and ranks == 1:  # nothing to average with: the tensor as it is, no job for the worker
        fut = Future(devices=[tensor.device]) if tensor.is_cuda else Future()
        fut.set_result(tensor)
        return fut
    tensor.div_(ranks)  # here, not in the worker: off the path between one bucket and the next
    if tensor.is_cuda:
        fut, ready = Future(devices=[tensor.device]), torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))  # the caller's stream: after gradients and division
    else:
        fut, ready = Future(), None
    # The route is read now, in hook order: the tuner switches it at bucket 0, before this step's buckets.
    state.worker.submit(functools.partial(_run_bucket, state, state.route, tensor, key,
                                          state.iteration if step is None else step, layout, fut, ready, scope))
    return fut


def _average_bucket(state: CommState, bucket, layout: Layout) -> Future:
    return average(state, bucket.buffer(), key=bucket.index(), layout=layout, scope=state.scope)


def comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average ``bucket`` across the ranks of ``state.scope`` with the algorithm in ``state``."""
    # (annotations are real objects here, no ``from __future__ import annotations``: DDP checks them)
    if state.tuner is not None:
        state.tuner.on_bucket(state, bucket)
    if state.compression == "int8" and state.feedback.enabled:  # residuals per bucket layout, replayed on resume
        fut = state.buckets.run(bucket, bucket_layout(bucket, state.parameter_numbers),
                                functools.partial(_average_bucket, state))
    else:
        fut = average(state, bucket.buffer(), key=bucket.index(), scope=state.scope)
    if bucket.is_last():
        state.iteration += 1
    return fut
