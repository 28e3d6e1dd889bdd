"""Communication autotuner: time candidate settings during warm-up, decide on rank 0, cache the result.

Follows ACSpeed (tuning bucket size and allreduce algorithm during warm-up, cached per model, size and
cluster). Two perf modes:

* ``comm``: before DDP is built, time :func:`aiak.comm.hooks.average` on buffers shaped like the model's
  real gradient buckets (parameters in reverse order, as DDP fills them), for each algorithm
  (flat/hierarchical x none/fp16/bf16[/int8]) at the configured bucket size, then each bucket size with the
  best algorithm. Communication only; nothing of the user's step runs.
* ``step``: DDP is built with the configured bucket size; over the first steps the hook switches algorithm
  every ``tune_steps`` synchronizing steps and times whole steps (bucket 0 to bucket 0). Bucket size is not
  tuned in this mode (DDP fixes it at construction and the returned object must stay the same).

Each rank measures; timings are max-reduced (a step is as slow as the slowest rank), rank 0 picks the
fastest and broadcasts it, so every rank runs the same algorithm. The tuner's own tensors (timings, the
choice, the cache broadcast) live on :func:`group_device`: CPU for gloo, the current CUDA device for NCCL,
which has no CPU path. Step times come from a :class:`StepClock`: CUDA events on the stream, not host time.
Results are cached in the one tuning cache (:mod:`aiak.tune.cache`, shared with the strategy trials), keyed
by model signature (class + parameter shapes), world size, local size, device type, torch version and perf
mode.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

import torch

from aiak.amp.warn import warn
import torch.distributed as dist

from aiak.comm.hooks import CommState, average
from aiak.tune.cache import TuneCache as _SharedCache

logger = logging.getLogger("aiak")
PERF_MODES = ("comm", "step")


@dataclass(frozen=True)
class CommChoice:
    """One candidate (and, once tuned, the decision)."""

    hierarchical: bool
    compression: str
    bucket_mb: float

    def describe(self) -> str:
        algo = "hierarchical" if self.hierarchical else "flat"
        algo = algo if self.compression == "none" else f"{algo}+{self.compression}"
        return f"{algo}, bucket {self.bucket_mb:g} MB"


# -- cache -------------------------------------------------------------------------------------
def model_signature(model: torch.nn.Module) -> str:
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    text = f"{type(model).__name__}:{shapes}"
    return f"{type(model).__name__}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def cache_key(model: torch.nn.Module, world_size: int, local_size: int, device_type: str, perf_mode: str) -> str:
    return (f"{model_signature(model)}|world={world_size}|local={local_size}|{device_type}"
            f"|torch={torch.__version__}|{perf_mode}")


class TuneCache(_SharedCache):
    """The shared tuning cache (:class:`aiak.tune.cache.TuneCache`), read and written as :class:`CommChoice`."""

    def get(self, key: str) -> Optional[CommChoice]:
        entry = self._read().get(key)
        try:
            return CommChoice(bool(entry["hierarchical"]), str(entry["compression"]), float(entry["bucket_mb"]))
        except (TypeError, KeyError, ValueError):
            if entry is not None:
                warn(f"aiak.comm: ignoring malformed tuning cache entry {key!r} in {self.path}")
            return None

    def put(self, key: str, choice: CommChoice, **extra) -> None:
        self.put_entry(key, {**asdict(choice), **extra})


# -- where the tuner's tensors live --------------------------------------------------------------
def device_type_for_backend(backend: str) -> str:
    """``cpu`` if one of the backends in ``backend`` (``gloo``, or ``cpu:gloo,cuda:nccl``) runs CPU tensors,
    else ``cuda``: NCCL has no CPU path, so CPU tensors in a collective on an NCCL group crash."""
    names = [part.rsplit(":", 1)[-1].strip().lower() for part in str(backend).split(",")]
    capability = getattr(dist.Backend, "backend_capability", {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]})
    return "cpu" if any("cpu" in capability.get(name, ()) for name in names) else "cuda"


def group_device(group=None) -> torch.device:
    """The device for the tuner's own tensors in collectives on ``group``: CPU where the group can, else the
    current CUDA device (with NCCL, ``torch.cuda.set_device(local_rank)`` makes that the gradient device)."""
    if device_type_for_backend(dist.get_backend(group)) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def shared_cache_lookup(cache: TuneCache, key: str, group=None) -> Optional[CommChoice]:
    """Rank 0 reads the cache and broadcasts the entry, so all ranks agree even without a shared disk."""
    box = [cache.get(key) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group, device=group_device(group))
    return box[0]


# -- deciding on rank 0 ------------------------------------------------------------------------
def decide(times: Sequence[float], group=None) -> int:
    """Index of the fastest candidate by the slowest rank's time; decided on rank 0, broadcast to all."""
    device = group_device(group)
    t = torch.tensor(list(times), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    choice = torch.argmin(t).reshape(1)  # int64, on ``device``
    dist.broadcast(choice, src=0, group=group)
    return int(choice)


def algorithm_candidates(hierarchical_available: bool, allow_int8: bool) -> List[tuple]:
    compressions = ["none", "fp16", "bf16"] + (["int8"] if allow_int8 else [])
    algos = [False, True] if hierarchical_available else [False]
    return [(h, c) for h in algos for c in compressions]


# -- comm mode ---------------------------------------------------------------------------------
def gradient_bucket_sizes(model: torch.nn.Module, bucket_mb: float) -> List[int]:
    """Element counts of DDP-like buckets: parameters in reverse order, filled up to ``bucket_mb``."""
    cap = bucket_mb * 1024 * 1024
    sizes, current, current_bytes = [], 0, 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        current += p.numel()
        current_bytes += p.numel() * p.element_size()
        if current_bytes >= cap:
            sizes.append(current)
            current, current_bytes = 0, 0
    if current:
        sizes.append(current)
    return sizes


def time_average(state: CommState, sizes: Sequence[int], repeats: int, device=None, group=None) -> float:
    """Median seconds to average buffers of ``sizes`` elements with ``state`` (one warm-up run first).

    ``device``: where the gradients live (default: :func:`group_device`)."""
    device = torch.device(device) if device is not None else group_device(group)
    buffers = [torch.randn(n, device=device) for n in sizes]
    times = []
    for i in range(repeats + 1):
        for b in buffers:
            b.normal_()
        dist.barrier(group=group)
        start = time.perf_counter()
        futures = [average(state, b, key=k) for k, b in enumerate(buffers)]
        torch.futures.wait_all(futures)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    state.feedback.reset()
    return statistics.median(times)


def tune_comm(model: torch.nn.Module, state: CommState, bucket_mbs: Sequence[float], allow_int8: bool,
              repeats: int = 3, device=None) -> CommChoice:
    """Comm-mode tuning (collective: every rank calls it at the same point). Leaves ``state`` on the winner."""
    group = state.process_group
    base_mb = bucket_mbs[0]
    algos = algorithm_candidates(state.groups is not None, allow_int8)
    sizes = gradient_bucket_sizes(model, base_mb)
    times = []
    for h, c in algos:
        state.set_algorithm(h, c)
        times.append(time_average(state, sizes, repeats, device, group))
    best = algos[decide(times, group)]
    state.set_algorithm(*best)
    report = [f"{CommChoice(h, c, base_mb).describe()}: {t * 1e3:.1f} ms" for (h, c), t in zip(algos, times)]
    bucket_times = [times[algos.index(best)]]
    for mb in bucket_mbs[1:]:
        bucket_times.append(time_average(state, gradient_bucket_sizes(model, mb), repeats, device, group))
        report.append(f"{CommChoice(*best, mb).describe()}: {bucket_times[-1] * 1e3:.1f} ms")
    mb = bucket_mbs[decide(bucket_times, group)]
    choice = CommChoice(best[0], best[1], mb)
    logger.info("aiak.comm autotune (comm mode) chose %s; measured: %s", choice.describe(), "; ".join(report))
    return choice


# -- step mode ---------------------------------------------------------------------------------
class StepClock:
    """Marks step boundaries where the work runs; seconds between two marks.

    CPU: ``time.perf_counter``. CUDA: an event recorded on the current stream at each mark, because host time
    between two hook calls is kernel-launch time, not step time. CUDA marks are read (one synchronisation) only
    by :meth:`seconds`, which the tuner calls once, when it has all its samples.
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class StepTuner:
    """Times whole training steps under each algorithm; attached to ``CommState.tuner`` by the DDP wrapper.

    Each candidate runs ``1 + steps`` synchronizing steps (the first is a warm-up); a step is timed from
    one bucket-0 hook call to the next, which covers its communication, the next forward and backward, on the
    :class:`StepClock` of the gradients' device (CUDA: stream time between events, not host time).
    """

    def __init__(self, candidates: Sequence[tuple], steps: int, bucket_mb: float,
                 on_decided: Optional[Callable[[CommChoice, List[float]], None]] = None):
        if steps < 1:
            raise ValueError(f"tune_steps must be >= 1, got {steps}")
        self.candidates = list(candidates)
        self.steps = steps
        self.bucket_mb = bucket_mb
        self.on_decided = on_decided
        self.samples: List[List[float]] = [[] for _ in self.candidates]  # seconds per timed step, once decided
        self.step = 0  # synchronizing steps seen
        self._clock: Optional[StepClock] = None
        self._intervals: List[List[tuple]] = [[] for _ in self.candidates]  # (start mark, end mark) per timed step
        self._last_mark = None
        self.choice: Optional[CommChoice] = None

    def _candidate_of(self, step: int) -> int:
        return step // (self.steps + 1)

    def on_bucket(self, state: CommState, bucket) -> None:
        if bucket.index() != 0:
            return
        if self._clock is None:
            self._clock = StepClock(bucket.buffer().device)
        now = self._clock.mark()
        if self._last_mark is not None:
            prev = self.step - 1
            idx, pos = divmod(prev, self.steps + 1)
            if pos > 0:  # not the warm-up step of its candidate
                self._intervals[idx].append((self._last_mark, now))
        self._last_mark = now
        idx = self._candidate_of(self.step)
        if idx >= len(self.candidates):
            self._finish(state)
            return
        state.set_algorithm(*self.candidates[idx])
        self.step += 1

    def _finish(self, state: CommState) -> None:
        self.samples = [[self._clock.seconds(a, b) for a, b in pairs] for pairs in self._intervals]
        times = [statistics.median(s) for s in self.samples]
        best = self.candidates[decide(times, state.process_group)]
        state.set_algorithm(*best)
        state.tuner = None
        self.choice = CommChoice(best[0], best[1], self.bucket_mb)
        report = "; ".join(f"{CommChoice(h, c, self.bucket_mb).describe()}: {t * 1e3:.1f} ms/step"
                           for (h, c), t in zip(self.candidates, times))
        logger.info("aiak.comm autotune (step mode) chose %s; measured: %s", self.choice.describe(), report)
        if self.on_decided is not None:
            self.on_decided(self.choice, times)
