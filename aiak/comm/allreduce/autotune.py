"""Communication autotuner: time candidate settings during warm-up, decide on rank 0, cache the result.

Follows ACSpeed (tuning bucket size and allreduce algorithm during warm-up, cached per model, size and
cluster). Two perf modes:

* ``comm``: before DDP is built, time `aiak.comm.allreduce.hooks.average` on buffers shaped like the model's
  real gradient buckets (parameters in reverse order, as DDP fills them), for each algorithm
  (flat/hierarchical x none/fp16/bf16[/int8]) at the configured bucket size, then each bucket size with the
  best algorithm. Communication only; nothing of the user's step runs.
* ``step``: DDP is built with the configured bucket size; over the first steps the hook switches algorithm
  every ``tune_steps`` synchronizing steps and times whole steps (bucket 0 to bucket 0). Bucket size is not
  tuned in this mode (DDP fixes it at construction and the returned object must stay the same).

Each rank measures; timings are max-reduced (a step is as slow as the slowest rank), rank 0 picks the
fastest and broadcasts it, so every rank runs the same algorithm. The tuner's own tensors (timings, the
choice, the cache broadcast) live on `group_device`: CPU for gloo, the current CUDA device for NCCL,
which has no CPU path. Step times come from a `StepClock`: CUDA events on the stream, not host time.
Results are cached in the one tuning cache (`aiak.util.cache`, shared with the strategy trials), keyed
by every input of the decision (`TuneInputs`: model signature, world and local size, device type, torch
version, perf mode, and the settings that change the candidates or how they are measured: int8 allowed,
hierarchical allowed and available, bucket sizes tried, timed runs, int8 block, intra-node compression,
pipeline chunk). A cached choice is applied only if the run's own settings allow it (`cached_choice`):
an entry written by another version, or edited, that picks int8 or hierarchical where the run forbids it is
tuned again, never applied.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
from dataclasses import asdict, astuple, dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from aiak.comm.allreduce.compression import COMPRESSIONS
from aiak.comm.allreduce.hooks import CommState, average, describe_route
from aiak.measure.clock import StepClock
from aiak.measure.rounds import Contender, alternate
from aiak.util.cache import TuneCache
from aiak.util.dist import group_device, max_across_ranks, rank0_index, rank0_object
from aiak.util.warn import warn

logger = logging.getLogger("aiak")
PERF_MODES = ("comm", "step")


@dataclass(frozen=True)
class CommChoice:
    """One candidate (and, once tuned, the decision)."""

    hierarchical: bool
    compression: str
    bucket_mb: float
    connections: int = 1   # TCP connections per peer on the stage that crosses nodes (aiak.comm.allreduce.connections)
    cpu_reduce: bool = False   # hierarchical, its cross-node stage on host copies over gloo (aiak.comm.allreduce.hooks)

    @property
    def route(self) -> Tuple[bool, str, int, bool]:
        """``(hierarchical, compression, connections, cpu_reduce)``, as `CommState.set_route` takes
        them."""
        return self.hierarchical, self.compression, self.connections, self.cpu_reduce

    def entry(self, **extra: Any) -> Dict[str, Any]:
        """The cache entry of this choice (`aiak.util.cache`), with ``extra`` beside it."""
        return {**asdict(self), **extra}

    def describe(self) -> str:
        return f"{describe_route(*self.route)}, bucket {self.bucket_mb:g} MB"


@dataclass
class CommTuning:
    """What the comm autotuner measured and chose: the ``comm`` part of the decision record
    (``aiak.last_decision()``), like the trials' rows. Filled as the tuner goes: in step mode, ``chosen`` stays
    empty until the first steps have been measured.

    ``candidates``: ``{"candidate", "set", "ms", "ms_spread", "chosen", "error"}`` per candidate measured, ``set``
    being which pass measured it (``algorithms``, ``connections``, ``bucket sizes``, ``steps``, ``NCCL sockets``);
    ``ms``: the slowest rank's median over the rounds, ``ms_spread``: its smallest and largest round (both None for
    a candidate that failed, ``error`` saying why). ``advice``: what to set before the next launch (NCCL's socket
    counts, which no process can change once NCCL has read them)."""

    mode: str                       # comm | step
    cache: str = ""                 # the cache file
    cache_hit: bool = False         # the choice came from the cache: nothing was measured now
    candidates: List[Dict[str, Any]] = field(default_factory=list)
    chosen: str = ""
    advice: str = ""

    def add(self, pass_name: str, labels: Sequence[str], stats: Sequence[Optional[Sequence[float]]], best: int,
            errors: Sequence[str] = ()) -> None:
        """One pass: ``stats`` holds ``(median, fastest, slowest)`` seconds per candidate (None: it failed, with
        ``errors[i]`` saying why); ``best`` indexes the winner."""
        for i, (label, stat) in enumerate(zip(labels, stats)):
            self.candidates.append({"candidate": label, "set": pass_name,
                                    "ms": stat[0] * 1e3 if stat else None,
                                    "ms_spread": [stat[1] * 1e3, stat[2] * 1e3] if stat else None,
                                    "chosen": i == best, "error": errors[i] if i < len(errors) else ""})

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def lines(self) -> List[str]:
        """The record's rows for `aiak.tune.decision.Decision.render`."""
        if self.cache_hit:
            return [f"comm autotune ({self.mode} mode): cached choice {self.chosen} (from {self.cache}; nothing "
                    "measured now)"]
        head = f"comm autotune ({self.mode} mode): " + (f"chose {self.chosen}" if self.chosen
                                                        else "measuring during the first steps")
        rows = [f"  {c['set']:<12} {c['candidate']:<48} " + (
            f"{c['ms']:>9.2f} ms ({c['ms_spread'][0]:.2f}-{c['ms_spread'][1]:.2f}){'  chosen' if c['chosen'] else ''}"
            if c["ms"] is not None else f"failed: {c['error']}") for c in self.candidates]
        return [head] + rows + ([f"  advice: {self.advice}"] if self.advice else [])


# -- cache -------------------------------------------------------------------------------------
def model_signature(model: torch.nn.Module) -> str:
    """Class name and a digest of the trained parameters' shapes and dtypes, in order: what fills the buckets."""
    params = [(tuple(p.shape), str(p.dtype)) for p in model.parameters() if p.requires_grad]
    text = f"{type(model).__name__}:{params}"
    return f"{type(model).__name__}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def cache_key(model: torch.nn.Module, world_size: int, local_size: int, device_type: str, perf_mode: str,
              **settings: Any) -> str:
    """``comm|model|world=|local=|device=|torch=|<settings, by name>|mode=`` (`TuneCache.key`);
    `TuneInputs.key` passes every decision input as ``settings``."""
    fields = {"world": world_size, "local": local_size, "device": device_type, "torch": torch.__version__}
    fields.update((name, settings[name]) for name in sorted(settings))
    fields["mode"] = perf_mode
    return TuneCache.key("comm", model_signature(model), fields)


@dataclass(frozen=True)
class TuneInputs:
    """Every input of one tuning decision besides the model: the candidates, and how they are measured.

    The cache key is made of all of them (`key`), and a cached choice is applied only where they allow it
    (`refusal`): a run must never inherit a choice it could not have made itself. (A key without the int8
    switch let a run with ``comm.tune_int8: false`` take int8 from an entry written when int8 was allowed.)
    """

    world_size: int
    local_size: int
    device_type: str  # where the gradients live: cpu | cuda
    perf_mode: str  # comm | step
    int8: bool  # int8 among the candidates: comm.tune_int8, or comm.compression: int8
    hierarchical: Union[str, bool]  # comm.hierarchical: auto | True | False
    groups: bool  # hierarchical groups exist (the topology and the process group allow them)
    bucket_mbs: Tuple[float, ...]  # bucket sizes tried (comm mode), or the one DDP is built with (step mode)
    tune_steps: int  # timed runs (comm mode) or steps (step mode) per candidate
    int8_block: int
    compress_intra: bool
    pipeline_mb: float
    connections: Tuple[int, ...] = (1,)  # TCP connections per peer tried (comm.connections), the first the base
    link: str = ""  # the nodes' host names and the interfaces named for the run: which network was measured
    cpu_reduce: bool = False  # CPU-Reduce candidates are measured (NCCL job with hierarchical groups, comm.cpu_reduce)

    @classmethod
    def of(cls, opts: Any, world_size: int, local_size: int, device_type: str, groups: bool,
           connections: Sequence[int] = (1,), link: str = "", cpu_reduce: bool = False) -> "TuneInputs":
        """The inputs of a run with the ``comm:`` settings ``opts`` (a `CommConfig`),
        trying ``connections`` (the ones set up for it).

        Comm mode tries the configured bucket size, 5 and 50 MB; step mode keeps the configured one (DDP fixes
        it at construction)."""
        bucket_mbs = (opts.bucket_mb, 5.0, 50.0) if opts.perf_mode == "comm" else (opts.bucket_mb,)
        int8 = bool(opts.tune_int8 or opts.compression == "int8")
        return cls(world_size, local_size, device_type, opts.perf_mode, int8, opts.hierarchical, groups,
                   tuple(float(mb) for mb in dict.fromkeys(bucket_mbs)), opts.tune_steps, opts.int8_block,
                   opts.compress_intra, opts.pipeline_mb, tuple(connections), link, cpu_reduce)

    @property
    def hierarchical_allowed(self) -> bool:
        """Hierarchical candidates are measured: groups exist and ``comm.hierarchical`` is not false."""
        return self.groups and self.hierarchical is not False

    def candidates(self) -> List[tuple]:
        """Step mode's candidates: every algorithm with every number of connections (CPU-Reduce: one)."""
        return [(h, c, k, host) for h, c, _, host in algorithm_candidates(self.hierarchical_allowed, self.int8,
                                                                          cpu_reduce=self.cpu_reduce)
                for k in self.connections if k == 1 or not host]

    def key(self, model: torch.nn.Module) -> str:
        settings = {f.name: value for f, value in zip(fields(self), astuple(self))
                    if f.name not in ("world_size", "local_size", "device_type", "perf_mode")}
        return cache_key(model, self.world_size, self.local_size, self.device_type, self.perf_mode, **settings)

    def refusal(self, choice: CommChoice) -> Optional[str]:
        """Why this run may not apply ``choice`` (``None``: it may): a choice outside its candidates."""
        if choice.compression not in COMPRESSIONS:
            return f"compression {choice.compression!r} is not one of {list(COMPRESSIONS)}"
        if choice.compression == "int8" and not self.int8:
            return "int8 is not allowed (comm.tune_int8 is false)"
        if choice.hierarchical and self.hierarchical is False:
            return "hierarchical allreduce is not allowed (comm.hierarchical is false)"
        if choice.hierarchical and not self.groups:
            return "hierarchical allreduce is unavailable here (single node, one rank per node, uneven nodes or a " \
                   "custom process group)"
        if choice.cpu_reduce and not (self.cpu_reduce and choice.hierarchical and choice.connections == 1):
            return "CPU-Reduce is not among this run's candidates (it needs an NCCL job with hierarchical groups, " \
                   "and comm.cpu_reduce not false)"
        if choice.connections not in self.connections:
            return f"{choice.connections} connections are not among those this run sets up {list(self.connections)}"
        if choice.bucket_mb not in self.bucket_mbs:
            return f"bucket {choice.bucket_mb:g} MB is not among the sizes this run tries {list(self.bucket_mbs)}"
        return None


# -- the cache, read on rank 0 ----------------------------------------------------------------
def read_choice(cache: TuneCache, key: str) -> Optional[CommChoice]:
    """The `CommChoice` cached under ``key``, or None (absent, or malformed: said once)."""
    entry = cache.get_entry(key)
    try:
        return CommChoice(bool(entry["hierarchical"]), str(entry["compression"]), float(entry["bucket_mb"]),
                          int(entry.get("connections", 1)), bool(entry.get("cpu_reduce", False)))
    except (TypeError, KeyError, ValueError):
        if entry is not None:
            warn(f"aiak.comm: ignoring malformed tuning cache entry {key!r} in {cache.path}")
        return None


def cached_choice(cache: TuneCache, key: str, inputs: TuneInputs, group=None) -> Optional[CommChoice]:
    """The entry under ``key``, read on rank 0 and broadcast (so the ranks agree without a shared disk), if
    ``inputs`` allow it, else ``None`` (tune again).

    Checked after the broadcast: every rank holds the same entry and the same inputs, so every rank agrees."""
    choice = rank0_object(lambda: read_choice(cache, key), group)
    why = inputs.refusal(choice) if choice is not None else None
    if why is not None:
        logger.info("aiak.comm autotune: cache entry %s in %s chose %s, which this run cannot apply: %s; tuning "
                    "again", key, cache.path, choice.describe(), why)
        return None
    return choice


# -- deciding on rank 0 ------------------------------------------------------------------------
CONNECTIONS_MARGIN = 0.1   # more connections are kept only when they are at least 10% faster than the first count


def decide(times: Sequence[float], group=None, keep_first_within: float = 0.0) -> int:
    """Index of the fastest candidate by the slowest rank's time; decided on rank 0, followed by all. With
    ``keep_first_within``, the first candidate (the simplest) is kept unless the fastest beats it by more than
    that fraction: on a link that does not cap each flow, 1 and 4 connections are within a few percent and a
    few rounds can order them either way (measured: 0.88-1.07x), and more connections cost sockets and threads."""
    slowest = max_across_ranks(times, group)
    best = min(range(len(slowest)), key=slowest.__getitem__)
    if slowest[best] * (1 + keep_first_within) >= slowest[0]:
        best = 0
    return rank0_index(best, group)


def algorithm_candidates(hierarchical_available: bool, allow_int8: bool, connections: int = 1,
                         cpu_reduce: bool = False) -> List[tuple]:
    """``(hierarchical, compression, connections, cpu_reduce)`` for every algorithm allowed, at ``connections``;
    with ``cpu_reduce``, each hierarchical one also as CPU-Reduce (over one connection)."""
    compressions = ["none", "fp16", "bf16"] + (["int8"] if allow_int8 else [])
    algos = [(False, False)] + ([(True, False)] if hierarchical_available else []) \
        + ([(True, True)] if hierarchical_available and cpu_reduce else [])
    return [(h, c, 1 if host else connections, host) for h, host in algos for c in compressions]


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


def _averaging(state: CommState, algorithm: tuple, buffers: List[torch.Tensor], group) -> Callable[[], None]:
    """One timed step of the comm mode: every bucket averaged with ``algorithm`` (all ranks start together)."""
    def step() -> None:
        state.set_route(*algorithm)
        for b in buffers:
            b.normal_()
        dist.barrier(group=group)
        torch.futures.wait_all([average(state, b, key=k) for k, b in enumerate(buffers)])
    return step


def _time_in_rounds(state: CommState, model: torch.nn.Module, candidates: List[CommChoice], repeats: int, device,
                    group) -> List[List[float]]:
    """The slowest rank's seconds of every round, per candidate, the candidates alternating in rounds on the one timing engine
    (`aiak.measure.rounds.alternate`: a warm-up each, then ``repeats`` rounds in rotating order), so that a
    slow minute of a shared link costs every candidate alike. Each candidate averages buffers of its bucket
    size's DDP buckets (`gradient_bucket_sizes`) with its algorithm."""
    device = torch.device(device) if device is not None else group_device(group)
    contenders = [Contender(c.describe(), _averaging(state, c.route, [torch.randn(n, device=device) for n in
                                                                          gradient_bucket_sizes(model, c.bucket_mb)],
                                                     group), device) for c in candidates]
    alternate(contenders, warmup=1, rounds=repeats, steps_per_round=1, group=group, slow_factor=float("inf"))
    state.feedback.reset()
    return [list(c.step_seconds) for c in contenders]


def tune_comm(model: torch.nn.Module, state: CommState, bucket_mbs: Sequence[float], allow_int8: bool,
              repeats: int = 3, device=None, *, allow_hierarchical: bool = True,
              connections: Sequence[int] = (1,), cpu_reduce: bool = False,
              record: Optional[CommTuning] = None) -> CommChoice:
    """Comm-mode tuning (collective: every rank calls it at the same point). Leaves ``state`` on the winner.

    Three sets, each timed in alternating rounds and decided on the slowest rank's times: the algorithms (at the
    first bucket size and the first of ``connections``), then ``connections`` with the best algorithm, then the
    bucket sizes with the best of both. Hierarchical candidates are timed where ``state`` has groups, unless
    ``allow_hierarchical`` is false (``comm.hierarchical: false``); with ``cpu_reduce`` (``state`` has a
    ``host_inter`` group), each hierarchical one also as CPU-Reduce. What was measured goes into ``record``."""
    group = state.process_group
    record = record if record is not None else CommTuning("comm")

    def fastest(pass_name: str, candidates: List[CommChoice], margin: float = 0.0) -> CommChoice:
        seconds = _time_in_rounds(state, model, candidates, repeats, device, group)
        best = decide([statistics.median(s) for s in seconds], group, keep_first_within=margin)
        record.add(pass_name, [c.describe() for c in candidates],
                   [(statistics.median(s), min(s), max(s)) for s in seconds], best)
        return candidates[best]

    best = fastest("algorithms", [CommChoice(h, c, bucket_mbs[0], k, host) for h, c, k, host in algorithm_candidates(
        state.groups is not None and allow_hierarchical, allow_int8, connections[0], cpu_reduce)])
    if len(connections) > 1 and not best.cpu_reduce:
        best = fastest("connections", [replace(best, connections=k) for k in connections], CONNECTIONS_MARGIN)
    if len(bucket_mbs) > 1:
        best = fastest("bucket sizes", [replace(best, bucket_mb=mb) for mb in bucket_mbs])
    state.set_route(*best.route)
    record.chosen = best.describe()
    logger.info("aiak.comm autotune (comm mode) chose %s; measured: %s", best.describe(), "; ".join(
        f"{c['candidate']}: {c['ms']:.1f} ms" for c in record.candidates))
    return best


# -- step mode ---------------------------------------------------------------------------------
class StepTuner:
    """Times whole training steps under each algorithm; attached to ``CommState.tuner`` by the DDP wrapper.

    Every candidate runs one warm-up step, then ``steps`` rounds follow, each running every candidate for one
    synchronizing step in an order rotated from round to round (alternation, as `aiak.measure.rounds`
    does: drift of the machine or the link costs every candidate alike). A step is timed from one bucket-0 hook
    call to the next, which covers its communication, the next forward and backward, on the `StepClock`
    of the gradients' device (CUDA: stream time between events, not host time).
    """

    def __init__(self, candidates: Sequence[tuple], steps: int, bucket_mb: float,
                 on_decided: Optional[Callable[[CommChoice, List[float]], None]] = None,
                 record: Optional[CommTuning] = None):
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
        self.record = record if record is not None else CommTuning("step")
        n = len(self.candidates)
        self._schedule = [(i, False) for i in range(n)] + [((r + j) % n, True) for r in range(steps) for j in range(n)]

    def on_bucket(self, state: CommState, bucket) -> None:
        if bucket.index() != 0:
            return
        if self._clock is None:
            self._clock = StepClock(bucket.buffer().device)
        now = self._clock.mark()
        if self._last_mark is not None:
            idx, timed = self._schedule[self.step - 1]
            if timed:
                self._intervals[idx].append((self._last_mark, now))
        self._last_mark = now
        if self.step >= len(self._schedule):
            self._finish(state)
            return
        state.set_route(*self.candidates[self._schedule[self.step][0]])
        self.step += 1

    def _finish(self, state: CommState) -> None:
        self.samples = [[self._clock.seconds(a, b) for a, b in pairs] for pairs in self._intervals]
        # per candidate the largest rank's median, fastest and slowest step (a step is as slow as its slowest rank)
        agreed = max_across_ranks([f(s) for s in self.samples for f in (statistics.median, min, max)],
                                  state.process_group)
        times = agreed[0::3]
        index = decide(times, state.process_group)
        best = self.candidates[index]
        state.set_route(*best)
        state.tuner = None
        self.choice = CommChoice(best[0], best[1], self.bucket_mb, *best[2:])
        choices = [CommChoice(h, c, self.bucket_mb, *rest) for h, c, *rest in self.candidates]
        self.record.add("steps", [c.describe() for c in choices], [agreed[3 * i:3 * i + 3] for i in range(len(choices))],
                        index)
        self.record.chosen = self.choice.describe()
        report = "; ".join(f"{CommChoice(h, c, self.bucket_mb, *rest).describe()}: {t * 1e3:.1f} ms/step"
                           for (h, c, *rest), t in zip(self.candidates, times))
        logger.info("aiak.comm autotune (step mode) chose %s; measured: %s", self.choice.describe(), report)
        if self.on_decided is not None:
            self.on_decided(self.choice, times)
