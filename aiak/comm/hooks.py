"""DDP communication hooks: flat or hierarchical allreduce, optionally compressed.

Contract (torch/distributed/algorithms/ddp_comm_hooks): ``hook(state, bucket) -> Future[Tensor]``.
One hook, :func:`comm_hook`, reads its algorithm from :class:`CommState` at every bucket, so the
autotuner can switch algorithms between steps on the same DDP object (a DDP accepts one hook only).

Hierarchical allreduce (two-level, as used for Swin over 25 Gb/s TCP): intra-node reduce-scatter, then
an inter-node allreduce of each shard (local rank ``i`` of every node carries shard ``i``: all local ranks
use the network in parallel, each with ``1/local_size`` of the bucket), then an intra-node allgather.
Buckets are cut into chunks (``pipeline_mb``) and the three stages are pipelined: while chunk ``k``
crosses the network, chunk ``k+1`` is reduce-scattered and chunk ``k-1`` allgathered on the node.
Compression wraps the inter-node step only by default (``compress_intra=False``): that is where the
bandwidth is scarce. int8 is Bagua's ByteGrad: reduce-scatter in compressed form (all-to-all of
quantized chunks), decompress and sum, compress the summed chunk, allgather; both quantizations keep an
error-feedback residual per bucket and chunk.

Averaging matches DDP's default: divide by the world size before communicating (also keeps fp16 from
overflowing). Collectives that depend on other collectives are issued from future callbacks, whose order
differs between ranks; so every collective is *submitted* to its group's :class:`_IssueQueue` up front, in
the hook (the same order on every rank), and a queue issues its collectives strictly in submission order,
each once its inputs are ready. Collectives on a group are thus issued in the same order on every rank.
"""
import logging
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from aiak.comm.compression import (CAST_DTYPES, ErrorFeedback, check_compression, dequantize_int8,
                                   dequantize_int8_chunks, int8_packed_bytes, pad_to_multiple, quantize_int8,
                                   quantize_int8_chunks)
from aiak.comm.topology import HierarchicalGroups

logger = logging.getLogger("aiak")
Future = torch.futures.Future


# -- futures and ordered issuing ---------------------------------------------------------------------
def _new_future(like: torch.Tensor) -> Future:
    return Future(devices=[like.device]) if like.is_cuda else Future()


def _done_future(value=None) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


def _forward(source: Future, target: Future) -> None:
    try:
        target.set_result(source.value())
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on ``target``
        target.set_exception(e)


class _IssueQueue:
    """Issues one group's collectives in submission order, each once its ``ready`` future completes."""

    def __init__(self):
        self._last_issued = _done_future()

    def submit(self, ready: Future, issue: Callable[[object], Future], like: torch.Tensor) -> Future:
        """``issue(ready.value())`` returns the collective's future; the result future mirrors it."""
        issued, out = Future(), _new_future(like)

        def go(_):
            try:
                value = ready.value()
                fut = issue(value)
            except BaseException as e:  # noqa: BLE001
                issued.set_result(None)
                out.set_exception(e)
                return
            issued.set_result(None)
            fut.add_done_callback(lambda f: _forward(f, out))

        torch.futures.collect_all([self._last_issued, ready]).add_done_callback(go)
        self._last_issued = issued
        return out


def _work_future(work, value):
    """Future resolving to ``value`` once ``work`` (an async collective) completes."""
    return work.get_future().then(lambda f: (f.value(), value)[1])


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> Future:
    """Future of ``output`` = this rank's chunk of the sum of ``input`` over ``group``.

    Gloo's reduce-scatter work has no future (``Work::getFuture not implemented``), so on gloo it is an
    all-to-all of the chunks followed by a local sum: the same bytes on the wire.
    """
    if dist.get_backend(group) == "gloo":
        received = torch.empty_like(input)
        work = dist.all_to_all_single(received, input, group=group, async_op=True)
        return work.get_future().then(
            lambda f: (f.value(), torch.sum(received.view(-1, output.numel()), dim=0, out=output))[1])
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # per call: the guard wraps it
    return _work_future(fn(output, input, group=group, async_op=True), output)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group) -> Future:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _work_future(fn(output, input, group=group, async_op=True), output)


# -- state -------------------------------------------------------------------------------------------
class CommState:
    """What :func:`comm_hook` does, switchable between steps.

    Args:
        process_group: the flat group (DDP's; ``None`` = world).
        groups: intra/inter groups from :func:`aiak.comm.topology.build_groups`; ``None`` = flat only.
        hierarchical: run the two-level algorithm (needs ``groups``).
        compression: ``none | fp16 | bf16 | int8``.
        compress_intra: also compress the intra-node reduce-scatter/allgather (fp16/bf16 only).
        int8_block: values per int8 block (one min/scale pair each).
        pipeline_mb: chunk size of the hierarchical pipeline (float32 MB); ``0`` = one chunk per bucket.
        error_feedback: keep int8 residuals (turning it off is for experiments only).
    """

    __slots__ = ("process_group", "world_size", "groups", "hierarchical", "compression", "compress_intra",
                 "int8_block", "pipeline_mb", "feedback", "tuner", "iteration", "_queues")

    def __init__(self, process_group=None, groups: Optional[HierarchicalGroups] = None, hierarchical: bool = False,
                 compression: str = "none", compress_intra: bool = False, int8_block: int = 2048,
                 pipeline_mb: float = 2.0, error_feedback: bool = True):
        if hierarchical and groups is None:
            raise ValueError("hierarchical=True needs groups (aiak.comm.topology.build_groups); it returns None "
                             "for uneven nodes, in which case pass hierarchical=False")
        if int8_block < 1:
            raise ValueError(f"int8_block must be >= 1, got {int8_block}")
        if pipeline_mb < 0:
            raise ValueError(f"pipeline_mb must be >= 0 (0 = no pipelining), got {pipeline_mb}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.groups = groups
        self.hierarchical = hierarchical
        self.compression = check_compression(compression)
        self.compress_intra = compress_intra
        self.int8_block = int8_block
        self.pipeline_mb = pipeline_mb
        self.feedback = ErrorFeedback(error_feedback)
        self.tuner = None  # an aiak.comm.autotune.StepTuner while tuning
        self.iteration = 0
        self._queues: Dict[str, _IssueQueue] = {}

    def queue(self, name: str) -> _IssueQueue:
        if name not in self._queues:
            self._queues[name] = _IssueQueue()
        return self._queues[name]

    def reset_queues(self) -> None:
        """Forget finished work (called at the first bucket of a step: DDP waited for the previous one)."""
        self._queues.clear()

    def set_algorithm(self, hierarchical: bool, compression: str) -> None:
        if hierarchical and self.groups is None:
            raise ValueError("hierarchical allreduce is unavailable (single node, one rank per node or uneven nodes)")
        if (hierarchical, compression) != (self.hierarchical, self.compression):
            self.feedback.reset()
        self.hierarchical, self.compression = hierarchical, check_compression(compression)

    def describe(self) -> str:
        algo = "hierarchical" if self.hierarchical else "flat"
        return algo if self.compression == "none" else f"{algo}+{self.compression}"


# -- group reductions on 1-D tensors (sum; the caller has already divided) ---------------------------
def _cast_allreduce(x: torch.Tensor, group, compression: str) -> Future:
    """Sum of ``x`` over ``group``, sent as ``compression`` (none/fp16/bf16); resolves to ``x``."""
    if compression == "none":
        return _work_future(dist.all_reduce(x, group=group, async_op=True), x)
    sent = x.to(CAST_DTYPES[compression])
    return dist.all_reduce(sent, group=group, async_op=True).get_future().then(lambda f: x.copy_(f.value()[0]))


def _int8_allreduce(x: torch.Tensor, ready: Future, queue: _IssueQueue, group, feedback: ErrorFeedback, key,
                    block: int) -> Future:
    """ByteGrad sum of ``x`` over ``group`` once ``ready`` completes; resolves to ``x``.

    All-to-all of int8 chunks (reduce-scatter in compressed form), decompress and sum this rank's chunk,
    re-quantize it, allgather. Both collectives are submitted to ``queue`` now.
    """
    size = dist.get_world_size(group)
    box = {}

    def scatter(_):
        padded, n = pad_to_multiple(x, size * block)
        chunk = padded.numel() // size
        local = feedback.add((key, "local"), padded)
        packed = quantize_int8_chunks(local, size, block)
        if feedback.enabled:
            feedback.update((key, "local"), local, dequantize_int8_chunks(packed, chunk, block))
        box.update(n=n, chunk=chunk, received=torch.empty_like(packed))
        return _work_future(dist.all_to_all_single(box["received"], packed, group=group, async_op=True), None)

    def gather(_):
        chunk, nbytes = box["chunk"], int8_packed_bytes(box["chunk"], block)
        total = dequantize_int8_chunks(box["received"], chunk, block).view(size, chunk).sum(0)
        total = feedback.add((key, "shard"), total)
        mine = quantize_int8(total, block)
        if feedback.enabled:
            feedback.update((key, "shard"), total, dequantize_int8(mine, chunk, block))
        box["gathered"] = torch.empty(size * nbytes, dtype=torch.uint8, device=x.device)
        return _all_gather(box["gathered"], mine, group)

    def unpack(_):
        if box["n"] == size * box["chunk"]:  # no padding: decode straight into the bucket
            return dequantize_int8_chunks(box["gathered"], box["chunk"], block, out=x)
        return x.copy_(dequantize_int8_chunks(box["gathered"], box["chunk"], block)[:box["n"]])

    scattered = queue.submit(ready, scatter, x)
    return queue.submit(scattered, gather, x).then(unpack)


def _hierarchical_allreduce(state: CommState, x: torch.Tensor, key) -> Future:
    """Pipelined intra reduce-scatter -> inter allreduce of this rank's shard -> intra allgather."""
    groups = state.groups
    local = len(groups.intra_ranks)
    padded, n = pad_to_multiple(x, local)
    intra_dtype = CAST_DTYPES.get(state.compression) if state.compress_intra else None
    send = padded.to(intra_dtype) if intra_dtype is not None else padded
    # A chunk holds ``pipeline_mb`` of fp32 values; under int8 twice as many values. Each int8 chunk pays two
    # collectives and several quantize passes: too small a chunk pays them too often, too large a one leaves
    # little to overlap. benchmarks/comm_netns.py (2 nodes x 2 ranks, 500 Mbit/s), hierarchical+int8 vs flat,
    # values per chunk 0.5M / 1M / 2M: 16 MB 3.56x / 4.28x / 3.74-4.01x, 64 MB 3.79x / 4.87x / 4.21x.
    bytes_per_value = 2 if state.compression == "int8" else 4
    per_chunk = padded.numel() if state.pipeline_mb == 0 else \
        max(local, int(state.pipeline_mb * 2**20 / bytes_per_value) // local * local)
    bounds = [(s, min(s + per_chunk, padded.numel())) for s in range(0, padded.numel(), per_chunk)]
    intra, inter = state.queue("intra"), state.queue("inter")
    start = _done_future()
    shards = [torch.empty((b - a) // local, dtype=send.dtype, device=x.device) for a, b in bounds]
    reduced: List[Future] = [
        intra.submit(start, lambda _, a=a, b=b, s=s: _reduce_scatter(s, send[a:b], groups.intra), x)
        for (a, b), s in zip(bounds, shards)]
    crossed = []
    for i, (rs, shard) in enumerate(zip(reduced, shards)):
        if state.compression == "int8":  # (the intra step is never int8: ``send`` stays float32)
            crossed.append(_int8_allreduce(shard, rs, inter, groups.inter, state.feedback, (key, i), state.int8_block))
        else:
            crossed.append(inter.submit(rs, lambda _, s=shard: _cast_allreduce(
                s.float() if s.dtype != torch.float32 else s, groups.inter, state.compression), x))
    gathered = [intra.submit(c, lambda r, a=a, b=b: _all_gather(
        send[a:b], r.to(send.dtype) if r.dtype != send.dtype else r, groups.intra), x)
        for c, (a, b) in zip(crossed, bounds)]
    done = torch.futures.collect_all(gathered)

    def finish(f):
        for g in f.value():
            g.value()  # re-raise a failed stage
        if send.data_ptr() != x.data_ptr():
            x.copy_(send[:n])
        return x

    out = _new_future(x)
    done.then(finish).add_done_callback(lambda f: _forward(f, out))
    return out


# -- the hook ----------------------------------------------------------------------------------------
def average(state: CommState, tensor: torch.Tensor, key=0) -> Future:
    """Average a 1-D tensor in place across ranks with ``state``'s algorithm; resolves to ``tensor``.

    Used by :func:`comm_hook` and, outside DDP, by benchmarks and the comm-mode tuner.
    """
    tensor.div_(state.world_size)
    if state.hierarchical:
        return _hierarchical_allreduce(state, tensor, key)
    if state.compression == "int8":
        return _int8_allreduce(tensor, _done_future(), state.queue("flat"), state.process_group, state.feedback,
                               key, state.int8_block)
    return _cast_allreduce(tensor, state.process_group, state.compression)  # one collective, issued in order


def comm_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: average ``bucket`` across ranks with the algorithm in ``state``."""
    # (annotations are real objects here, no ``from __future__ import annotations``: DDP checks them)
    if state.tuner is not None:
        state.tuner.on_bucket(state, bucket)
    if bucket.index() == 0:
        state.reset_queues()
    fut = average(state, bucket.buffer(), key=bucket.index())
    if bucket.is_last():
        state.iteration += 1
    return fut
