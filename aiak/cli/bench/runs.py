"""The contenders of ``aiak bench`` and how they run: the torchrun world, one training loop per contender
(its memory sampling and random stream), the timing, the traces and the single-worker measurement."""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from aiak.cli.bench.options import TRACE_STEPS
from aiak.util.dist import max_across_ranks

SEED = 0
DIST_TIMEOUT_S = 300             # every collective of a torchrun job: a rank that disappears fails the job then


# ------------------------------------------------------------------------------------------ torchrun

class World:
    """This process's place in a torchrun job (``size`` 1 outside one) and the device its steps run on."""

    def __init__(self, rank: int, size: int, local_rank: int, device, owns_group: bool = False):
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device
        self.owns_group = owns_group          # bench initialised torch.distributed, so bench tears it down

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, requested) -> "World":
        """Reads torchrun's environment; with ``WORLD_SIZE`` > 1 initialises ``torch.distributed`` (env://)."""
        import torch

        try:
            size, rank, local_rank = (int(os.environ.get(k) or default) for k, default in
                                      (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
        except ValueError:
            raise UsageError("WORLD_SIZE, RANK and LOCAL_RANK must be whole numbers (torchrun sets them)") from None
        device = requested or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda":
            index = local_rank if size > 1 else (device.index if device.index is not None else 0)
            if index >= torch.cuda.device_count():
                raise UsageError(f"argument --device: local rank {local_rank} needs cuda:{index}, this machine has "
                                  f"{torch.cuda.device_count()} GPU(s); run fewer processes per node")
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
        if size > 1:
            import datetime

            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                        timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
                return cls(rank, size, local_rank, device, owns_group=True)
        return cls(rank, size, local_rank, device)

    def agree_any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on one (so that all ranks drop the same contender)."""
        return self.agree_max(1.0 if flag else 0.0) > 0

    def agree_max(self, value: float) -> float:
        """The largest ``value`` of all ranks, on every rank."""
        return max_across_ranks([value])[0]

    def leave(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class UsageError(Exception):
    """A mistake of the user's found after parsing: one line, exit code 2."""


# ------------------------------------------------------------------------------------------ one contender

def _rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``), or its peak so far where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Memory:
    """The peak memory of each contender while it runs (see the module docstring for what it counts)."""

    def __init__(self, device):
        import torch

        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "rss"
        self.peak: Dict[str, int] = {}
        self._current: Optional[str] = None
        self._torch = torch

    def enter(self, name: str) -> None:
        """Called at each step: a new run of ``name``'s steps restarts CUDA's high-water mark."""
        if self._current != name and self.kind == "cuda":
            self._torch.cuda.reset_peak_memory_stats(self.device)
        self._current = name

    def sample(self, name: str) -> None:
        value = self._torch.cuda.max_memory_allocated(self.device) if self.kind == "cuda" else _rss_bytes()
        if value > self.peak.get(name, 0):
            self.peak[name] = value


class _RandomStream:
    """A contender's own torch RNG stream (CPU, and CUDA's on a GPU), seeded alike for all: dropout draws the
    same masks in every contender's n-th step although their steps interleave, so plain PyTorch under another
    name ends at the baseline's loss exactly."""

    def __init__(self, device, seed: int = SEED):
        import torch

        self.torch, self.cuda = torch, device if device.type == "cuda" else None
        with torch.random.fork_rng(devices=[self.cuda] if self.cuda is not None else []):
            torch.manual_seed(seed)
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None

    @contextmanager
    def active(self):
        torch = self.torch
        torch.set_rng_state(self.cpu_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda_state, self.cuda)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            if self.cuda is not None:
                self.cuda_state = torch.cuda.get_rng_state(self.cuda)


class Loop:
    """One contender's training loop, as a user writes it; `step` is one iteration, drawing random
    numbers from the contender's own `_RandomStream`.

    ``catch``: an exception in a step is recorded in ``failure`` (later steps do nothing) instead of raised,
    so that a failing strategy does not end the others' run; the baseline's exceptions are raised.
    """

    def __init__(self, name: str, model, optimizer, loader, device, memory: Optional[Memory], catch: bool = True):
        self.name, self.model, self.optimizer, self.loader, self.device = name, model, optimizer, loader, device
        self.memory, self.catch = memory, catch
        self.failure: Optional[str] = None
        self.steps = 0
        self.random = _RandomStream(device)
        self._batches = None
        from aiak.util.nested import map_tensors

        self._map_tensors = map_tensors

    def _next_batch(self):
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:                 # the loader's end: the next epoch, as a loop over epochs does
            self._batches = iter(self.loader)
            return next(self._batches)

    def _step(self):
        from aiak.cli.model_spec import compute_loss
        from aiak.step.training_step import training_step

        memory = self.memory
        if memory is not None:
            memory.enter(self.name)
        batch = self._map_tensors(self._next_batch(), lambda t: t.to(self.device, non_blocking=True))
        return training_step(self.model, self.optimizer, batch, compute_loss,
                             None if memory is None else lambda _phase: memory.sample(self.name))

    def step(self):
        if self.failure is not None:
            return None
        self.steps += 1
        try:
            with self.random.active():
                return self._step()
        except Exception as e:
            self.failure = f"failed in its step {self.steps}: {type(e).__name__}: {_one_line(e)}"
            if not self.catch:
                raise
            return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]


@dataclass
class Entry:
    """A contender of the comparison: its loop (None when its setup failed), timings and what it reports."""

    name: str
    loop: Optional[Loop]
    contender: Any                   # aiak.measure.rounds.Contender
    setup_s: float
    failure: Optional[str] = None
    decision: Optional[dict] = None
    solo: Any = None                 # its single-worker Contender under torchrun
    solo_loop: Optional[Loop] = None

    @property
    def failed(self) -> Optional[str]:
        return self.failure or (self.loop.failure if self.loop is not None else None)


@contextmanager
def _aiak_logging(level: int):
    logger = logging.getLogger("aiak")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _build(args, warmup: int, steps: int):
    from aiak.cli import model_spec

    batch = args.batch_size or model_spec.DEFAULT_BATCH_SIZE.get(args.model, 32)
    return model_spec.build(args.model, batch_size=args.batch_size, input_shape=args.input_shape,
                            samples=batch * (warmup + steps), seed=SEED)


def build_baseline(args, world: World, memory: Memory, warmup: int, steps: int):
    """Plain PyTorch: the SPEC's objects untouched; under torchrun the model in DDP as aiak wraps it (its
    default ``comm`` settings are DDP's own: 25 MB buckets, the built-in allreduce). Returns the entry and the
    `ModelSetup` (for its description and batch size)."""
    from aiak.measure.rounds import Contender
    from aiak.runtime.switches import read_switches

    setup = _build(args, warmup, steps)
    start = time.perf_counter()
    model = setup.model.to(world.device)
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    setup_s = time.perf_counter() - start
    loop = Loop("baseline", model, setup.optimizer, setup.loader, world.device, memory, catch=False)
    return Entry("baseline", loop, Contender("baseline", loop.step, world.device, read_switches()), setup_s), setup


def build_strategy(name: str, args, world: World, memory: Memory, warmup: int, steps: int, say) -> Entry:
    """``aiak.optimize`` on a fresh build of the SPEC; an exception there is this contender's failure."""
    import aiak
    from aiak.measure.rounds import Contender
    from aiak.runtime.switches import read_switches

    setup = _build(args, warmup, steps)
    say(f"  {name}: aiak.optimize(strategy={name!r}){' with its trials' if name == 'auto' else ''} ...")
    start = time.perf_counter()
    failure, decision = None, None
    try:
        with _aiak_logging(logging.WARNING if world.leader else logging.ERROR):
            model, optimizer, loader = aiak.optimize(setup.model, setup.optimizer, setup.loader, strategy=name,
                                                     device=world.device)
        made = aiak.last_decision()
        decision = _decision_summary(made.to_dict()) if made is not None else None
    except Exception as e:
        failure = f"failed in aiak.optimize(): {type(e).__name__}: {_one_line(e)}"
    setup_s = time.perf_counter() - start
    if world.agree_any(failure is not None) and failure is None:
        failure = "failed in aiak.optimize() on another rank (its log says why)"
    if failure is not None:
        say(f"  {name}: {failure}")
        return Entry(name, None, None, setup_s, failure=failure)
    say(f"  {name}: ready in {setup_s:.1f} s")
    loop = Loop(name, model, optimizer, loader, world.device, memory)
    return Entry(name, loop, Contender(name, loop.step, world.device, read_switches()), setup_s, decision=decision)


def _decision_summary(decision: dict) -> dict:
    """What a strategy changed from plain PyTorch (knob: value), and whether its trials ran or were cached."""
    changed = {path: knob["value"] for path, knob in decision.get("knobs", {}).items() if knob["source"] != "default"}
    return {"strategy": decision.get("strategy", {}).get("name"), "changed": changed,
            "tuning_seconds": decision.get("tuning_seconds"), "cache_hit": decision.get("cache_hit")}


# ------------------------------------------------------------------------------------------ the runs

def time_all(entries: List[Entry], warmup: int, rounds: int, per_round: int, board) -> None:
    from aiak.measure.rounds import alternate

    def progress(c, done, total):
        board.update(c.name, done, None if math.isnan(c.loss) else c.loss)

    alternate([e.contender for e in entries], warmup=warmup, rounds=rounds, steps_per_round=per_round,
              progress=progress)


def _safe_name(name: str, taken: set) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "strategy"
    safe, n = base, 2
    while safe in taken:
        safe, n = f"{base}-{n}", n + 1
    taken.add(safe)
    return safe


def write_traces(entries: List[Entry], directory: str, world: World, say) -> Dict[str, str]:
    """A ``torch.profiler`` trace of `TRACE_STEPS` steps of each contender still running; every rank
    runs the steps (DDP's collectives need them all), rank 0 records and writes them."""
    if world.device.type == "cpu":        # Kineto's start/stop lines and "gpuGetDeviceCount failed": noise here
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile, record_function

    from aiak.runtime.switches import write_switches

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    written, taken = {}, set()
    for e in entries:
        write_switches(e.contender.switches)  # the contender's TF32 / cuDNN settings, as in its timed steps
        e.loop.memory = None               # the profiler's own allocations are not the contender's
        if not world.leader:
            for _ in range(TRACE_STEPS):
                e.loop.step()
            continue
        with profile(activities=activities) as prof:
            for i in range(TRACE_STEPS):
                with record_function(f"aiak.cli.bench {e.name} step {i + 1}"):
                    e.loop.step()
        path = os.path.join(directory, _safe_name(e.name, taken) + ".json")
        prof.export_chrome_trace(path)
        written[e.name] = path
        say(f"  trace of {e.name}: {path}")
    return written


def _unwrapped(model, device):
    """The single-worker model: the module inside DDP, compiled again if aiak compiled the DDP object."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = model.module if isinstance(model, DDP) else model
    if inner is not model and getattr(model, "_compiled_call_impl", None) is not None:
        from aiak.runtime.compile import apply_compile

        apply_compile(inner, device)
    return inner


def single_worker(entries: List[Entry], world: World, warmup: int, rounds: int, per_round: int, say) -> None:
    """Rank 0 times every contender alone (see the module docstring); the other ranks wait in a barrier."""
    import datetime

    import torch.distributed as dist

    from aiak.measure.rounds import Contender, alternate

    expected = sum((warmup + rounds * per_round) * max(e.contender.step_seconds) for e in entries)
    timeout = 120 + 10 * world.agree_max(expected)
    waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    if world.leader:
        say(f"  single worker: rank 0 alone, the other {world.size - 1} rank(s) waiting (up to {timeout:.0f} s)")
        for e in entries:
            loop = Loop(e.name, _unwrapped(e.loop.model, world.device), e.loop.optimizer, e.loop.loader,
                         world.device, None, catch=e.loop.catch)
            e.solo, e.solo_loop = Contender(e.name, loop.step, world.device, e.contender.switches), loop
        alternate([e.solo for e in entries], warmup=warmup, rounds=rounds, steps_per_round=per_round,
                  across_ranks=False)
    dist.barrier(group=waiting)
    dist.destroy_process_group(waiting)


