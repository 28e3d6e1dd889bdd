"""``aiak bench``: a model's training step timed under plain PyTorch and under each strategy, in rounds.

    aiak bench [--model SPEC] [--strategy S ...] [--batch-size N] [--input-shape C,H,W] [--steps N]
               [--warmup N] [--rounds N] [--device D] [--json] [--trace DIR] [--plot FILE.png]

Every contender is built from the same SPEC (:func:`aiak.model_spec.build`) with the same seed, so all start
from the same weights and read the same batches in the same order: ``baseline`` is that setup untouched (plain
PyTorch, wrapped in DDP by hand under torchrun, as aiak wraps it), each strategy is ``aiak.optimize(model,
optimizer, loader, strategy=S)`` on a fresh build (``setup_s`` times that call, the trials of ``auto``
included; with the tuning cache warm, ``auto`` reuses its last decision and its trials do not run). A step is
what a user's loop does: next batch (the loader is re-iterated at its end), to the device,
:func:`aiak.model_spec.compute_loss`, ``backward()``, ``optimizer.step()``, ``zero_grad()``. Each contender
draws its random numbers (dropout) from its own stream, seeded alike, although the steps interleave: plain
PyTorch under another name (``--strategy default``) ends at the baseline's loss exactly.

Timing is :func:`aiak.measure.alternate`: everybody warms up, the timed steps are cut into rounds in rotating
order, the speedup is the median of the per-round ratios with its confidence interval, "within noise" when
that interval holds 1.00x; a strategy over 10x slower than the baseline on its first timed step is stopped.
A strategy that raises in ``optimize()`` or in a step is reported as failed (exit code 1); the others go on.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated``, reset whenever a contender's run of steps starts; on
a CPU the process RSS (``/proc/self/statm``) sampled after each forward, backward and optimizer step of the
contender. Both are the whole process's: every contender's weights live in it at once.

Under torchrun (``WORLD_SIZE`` > 1) bench joins the process group itself (gloo on CPU, NCCL on CUDA, env://,
with a timeout), every rank runs every contender on the same synthetic batches and only rank 0 prints. A
contender that fails on one rank is dropped on all (a failure that leaves the other ranks inside a collective
ends there at the process-group timeout, :data:`DIST_TIMEOUT_S`). Linearity is per contender: the
multi-worker throughput / the single-worker throughput / workers, which is the single-worker median step over
the multi-worker one. The single worker is measured on rank 0 alone after the timing (and any trace): the same
model unwrapped from DDP (recompiled if the strategy compiled it), its optimizer and loader, the same warm-up
and rounds, the contenders alternating again, while the other ranks wait in a barrier whose timeout is ten
times rank 0's expected time plus two minutes. The idle ranks leave rank 0 the machine, as on a job of one
worker; rank 0 keeps the thread count torchrun gave it.

With ``--json`` stdout carries one JSON object and nothing else (``aiak bench --json | jq`` works); the table
goes to stderr then. ``--plot`` draws every step, warm-up included (shaded), per contender.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from aiak.cli_args import device as device_type, input_shape, whole_number

__all__ = ["add_arguments", "run"]

SEED = 0
TRACE_STEPS = 3
DIST_TIMEOUT_S = 300             # every collective of a torchrun job: a rank that disappears fails the job then
MODEL_HELP = ("demo, timm:NAME, torchvision:NAME, hf:TYPE or path/to/file.py:factory; random weights, synthetic "
              "data, nothing downloaded")


def add_arguments(parser) -> None:
    """The options of ``aiak bench`` (``aiak.cli`` builds the subcommand's parser and calls this)."""
    parser.add_argument("--model", default="demo", metavar="SPEC", help=MODEL_HELP)
    parser.add_argument("--strategy", action="append", default=None, metavar="STRATEGY",
                        help="auto, a built-in profile name (aiak profiles lists them) or a path to a YAML profile; "
                             "repeat it to compare several (default: auto)")
    parser.add_argument("--batch-size", type=whole_number(1), default=None, metavar="N",
                        help="samples per step on each worker (default: 64 for demo, 32 otherwise)")
    parser.add_argument("--input-shape", type=input_shape, default=None, metavar="C,H,W",
                        help="image size (e.g. 3,64,64), or one number, the sequence length, for a text model "
                             "(default: the model's own)")
    parser.add_argument("--steps", type=whole_number(1), default=30, metavar="N",
                        help="timed steps per contender, cut into --rounds rounds (at least --rounds)")
    parser.add_argument("--warmup", type=whole_number(0), default=5, metavar="N",
                        help="untimed steps per contender first, alternating (they train too)")
    parser.add_argument("--rounds", type=whole_number(1), default=10, metavar="N",
                        help="rounds of alternation; the speedup is the median of their ratios (6 or more for a "
                             "verdict)")
    parser.add_argument("--device", type=device_type, default=None, metavar="D",
                        help="cpu, cuda or cuda:N (default: cuda when available, else cpu; under torchrun each rank "
                             "takes cuda:LOCAL_RANK)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout, and the table on stderr")
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help=f"after the timing, write a torch.profiler trace of {TRACE_STEPS} steps of each "
                             "contender to DIR/<name>.json (opens in https://ui.perfetto.dev)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help='draw step time over steps, one line per contender (needs pip install "aiak[plot]")')
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or status lines")


# ------------------------------------------------------------------------------------------ checks up front

def _usage_error(message: str) -> int:
    hint = " (see aiak bench --help)" if message.startswith("argument ") else ""
    sys.stderr.write(f"aiak bench: {message}{hint}\n")
    return 2


def _writable_dir(path: str, create: bool) -> Optional[str]:
    """None if files can be created in ``path`` (made first if ``create``), else why not."""
    import tempfile

    try:
        if create:
            os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{e.strerror or e} ({path})"
    return None


def _check_arguments(args, strategies: List[str]) -> Optional[str]:
    """The first mistake in the arguments that argparse cannot see alone, as one line; None if there is none."""
    if args.steps < args.rounds:
        return (f"argument --steps: must be at least --rounds ({args.rounds}) so that every round times a step, "
                f"got {args.steps}")
    seen = set()
    for name in strategies:
        if name in seen:
            return f"argument --strategy: {name!r} is given twice"
        if name == "baseline":
            return "argument --strategy: 'baseline' is plain PyTorch, always run; name a strategy to compare with it"
        seen.add(name)
    if args.trace is not None:
        why = _writable_dir(args.trace, create=True)
        if why:
            return f"argument --trace: cannot write traces to {args.trace!r}: {why}"
    if args.plot is not None:
        try:
            import matplotlib
        except ImportError:
            return '--plot needs matplotlib: pip install "aiak[plot]"'
        matplotlib.use("Agg")
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if suffix not in FigureCanvasBase.get_supported_filetypes():
            return (f"argument --plot: {args.plot!r} has no image suffix matplotlib writes; use .png "
                    f"(or one of {', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))})")
        why = _writable_dir(os.path.dirname(os.path.abspath(args.plot)), create=False)
        if why:
            return f"argument --plot: cannot write {args.plot!r}: {why}"
    return None


def _load_strategies(strategies: List[str]) -> Optional[str]:
    """Every strategy but ``auto`` loaded before anything is built: a misspelt profile is the user's mistake."""
    from aiak.strategy import StrategyError, load_strategy

    for name in strategies:
        if name != "auto":
            try:
                load_strategy(name)
            except StrategyError as e:
                return f"argument --strategy {name!r}: {e}"
    return None


# ------------------------------------------------------------------------------------------ torchrun

class _World:
    """This process's place in a torchrun job (``size`` 1 outside one) and the device its steps run on."""

    def __init__(self, rank: int, size: int, local_rank: int, device, owns_group: bool = False):
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device
        self.owns_group = owns_group          # bench initialised torch.distributed, so bench tears it down

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, requested) -> "_World":
        """Reads torchrun's environment; with ``WORLD_SIZE`` > 1 initialises ``torch.distributed`` (env://)."""
        import torch

        try:
            size, rank, local_rank = (int(os.environ.get(k) or default) for k, default in
                                      (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
        except ValueError:
            raise _UsageError("WORLD_SIZE, RANK and LOCAL_RANK must be whole numbers (torchrun sets them)") from None
        device = requested or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda":
            index = local_rank if size > 1 else (device.index if device.index is not None else 0)
            if index >= torch.cuda.device_count():
                raise _UsageError(f"argument --device: local rank {local_rank} needs cuda:{index}, this machine has "
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
        if self.size == 1:
            return value
        import torch
        import torch.distributed as dist

        from aiak.comm.autotune import group_device

        t = torch.tensor([value], dtype=torch.float64, device=group_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def leave(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class _UsageError(Exception):
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


class _Memory:
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


def _to_device(batch: Any, device) -> Any:
    if hasattr(batch, "to"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


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


class _Loop:
    """One contender's training loop, as a user writes it; :meth:`step` is one iteration, drawing random
    numbers from the contender's own :class:`_RandomStream`.

    ``catch``: an exception in a step is recorded in ``failure`` (later steps do nothing) instead of raised,
    so that a failing strategy does not end the others' run; the baseline's exceptions are raised.
    """

    def __init__(self, name: str, model, optimizer, loader, device, memory: Optional[_Memory], catch: bool = True):
        self.name, self.model, self.optimizer, self.loader, self.device = name, model, optimizer, loader, device
        self.memory, self.catch = memory, catch
        self.failure: Optional[str] = None
        self.steps = 0
        self.random = _RandomStream(device)
        self._batches = None

    def _next_batch(self):
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:                 # the loader's end: the next epoch, as a loop over epochs does
            self._batches = iter(self.loader)
            return next(self._batches)

    def _step(self):
        from aiak.model_spec import compute_loss

        memory = self.memory
        if memory is not None:
            memory.enter(self.name)
        batch = _to_device(self._next_batch(), self.device)
        loss = compute_loss(self.model, batch)
        if memory is not None:
            memory.sample(self.name)
        loss.backward()
        if memory is not None:
            memory.sample(self.name)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if memory is not None:
            memory.sample(self.name)
        return loss

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
class _Entry:
    """A contender of the comparison: its loop (None when its setup failed), timings and what it reports."""

    name: str
    loop: Optional[_Loop]
    contender: Any                   # aiak.measure.Contender
    setup_s: float
    failure: Optional[str] = None
    decision: Optional[dict] = None
    solo: Any = None                 # its single-worker Contender under torchrun
    solo_loop: Optional[_Loop] = None

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
    from aiak import model_spec

    batch = args.batch_size or model_spec.DEFAULT_BATCH_SIZE.get(args.model, 32)
    return model_spec.build(args.model, batch_size=args.batch_size, input_shape=args.input_shape,
                            samples=batch * (warmup + steps), seed=SEED)


def _baseline(args, world: _World, memory: _Memory, warmup: int, steps: int):
    """Plain PyTorch: the SPEC's objects untouched; under torchrun the model in DDP as aiak wraps it (its
    default ``comm`` settings are DDP's own: 25 MB buckets, the built-in allreduce). Returns the entry and the
    :class:`~aiak.model_spec.ModelSetup` (for its description and batch size)."""
    from aiak.measure import Contender

    setup = _build(args, warmup, steps)
    start = time.perf_counter()
    model = setup.model.to(world.device)
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    setup_s = time.perf_counter() - start
    loop = _Loop("baseline", model, setup.optimizer, setup.loader, world.device, memory, catch=False)
    return _Entry("baseline", loop, Contender("baseline", loop.step, world.device), setup_s), setup


def _strategy(name: str, args, world: _World, memory: _Memory, warmup: int, steps: int, say) -> _Entry:
    """``aiak.optimize`` on a fresh build of the SPEC; an exception there is this contender's failure."""
    import aiak
    from aiak.measure import Contender

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
        return _Entry(name, None, None, setup_s, failure=failure)
    say(f"  {name}: ready in {setup_s:.1f} s")
    loop = _Loop(name, model, optimizer, loader, world.device, memory)
    return _Entry(name, loop, Contender(name, loop.step, world.device), setup_s, decision=decision)


def _decision_summary(decision: dict) -> dict:
    """What a strategy changed from plain PyTorch (knob: value), and whether its trials ran or were cached."""
    changed = {path: knob["value"] for path, knob in decision.get("knobs", {}).items() if knob["source"] != "default"}
    return {"strategy": decision.get("strategy", {}).get("name"), "changed": changed,
            "tuning_seconds": decision.get("tuning_seconds"), "cache_hit": decision.get("cache_hit")}


# ------------------------------------------------------------------------------------------ the runs

def _time(entries: List[_Entry], warmup: int, rounds: int, per_round: int, board) -> None:
    from aiak.measure import alternate

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


def _trace(entries: List[_Entry], directory: str, world: _World, say) -> Dict[str, str]:
    """A ``torch.profiler`` trace of :data:`TRACE_STEPS` steps of each contender still running; every rank
    runs the steps (DDP's collectives need them all), rank 0 records and writes them."""
    if world.device.type == "cpu":        # Kineto's start/stop lines and "gpuGetDeviceCount failed": noise here
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    written, taken = {}, set()
    for e in entries:
        e.loop.memory = None               # the profiler's own allocations are not the contender's
        if not world.leader:
            for _ in range(TRACE_STEPS):
                e.loop.step()
            continue
        with profile(activities=activities) as prof:
            for i in range(TRACE_STEPS):
                with record_function(f"aiak.bench {e.name} step {i + 1}"):
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
        from aiak.amp.compile import apply_compile

        apply_compile(inner, device)
    return inner


def _single_worker(entries: List[_Entry], world: _World, warmup: int, rounds: int, per_round: int, say) -> None:
    """Rank 0 times every contender alone (see the module docstring); the other ranks wait in a barrier."""
    import datetime

    import torch.distributed as dist

    from aiak.measure import Contender, alternate

    expected = sum((warmup + rounds * per_round) * max(e.contender.step_seconds) for e in entries)
    timeout = 120 + 10 * world.agree_max(expected)
    waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    if world.leader:
        say(f"  single worker: rank 0 alone, the other {world.size - 1} rank(s) waiting (up to {timeout:.0f} s)")
        for e in entries:
            loop = _Loop(e.name, _unwrapped(e.loop.model, world.device), e.loop.optimizer, e.loop.loader,
                         world.device, None, catch=e.loop.catch)
            e.solo, e.solo_loop = Contender(e.name, loop.step, world.device), loop
        alternate([e.solo for e in entries], warmup=warmup, rounds=rounds, steps_per_round=per_round,
                  across_ranks=False)
    dist.barrier(group=waiting)
    dist.destroy_process_group(waiting)


# ------------------------------------------------------------------------------------------ the report

def _stats(e: _Entry, baseline: _Entry, batch: int, world: _World, memory: _Memory) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.measure import Spread, speedup

    out = {"ddp": e.loop is not None and isinstance(e.loop.model, DDP),
           "step_ms": None, "samples_per_s": None, "peak_mem_mb": None, "mem_kind": memory.kind,
           "setup_s": e.setup_s, "final_loss": None, "speedup": None, "speedup_interval": None,
           "verdict": None, "stopped": None, "failed": e.failed, "linearity": None,
           "single_worker_samples_per_s": None}
    if e.decision is not None:
        out["decision"] = e.decision
    if e.failed:
        out["verdict"] = "failed"
        return out
    c = e.contender
    step = Spread.of(c.step_seconds).scaled(1e3)
    out.update(step_ms={"median": step.median, "p10": step.p10, "p90": step.p90}, final_loss=c.loss,
               samples_per_s=batch * world.size / (step.median / 1e3), stopped=c.stopped)
    if e.name in memory.peak:
        out["peak_mem_mb"] = memory.peak[e.name] / 2 ** 20
    if e is not baseline:
        if c.stopped:
            out.update(verdict="stopped", speedup=baseline.contender.step_seconds[0] / c.step_seconds[0])
        else:
            ratio = speedup(baseline.contender.round_seconds, c.round_seconds)
            out.update(speedup=ratio.median, speedup_interval=ratio.to_dict(), verdict=ratio.verdict,
                       describe=ratio.describe())
    if e.solo is not None and e.solo.step_seconds and not e.solo_loop.failure:
        solo = statistics.median(e.solo.step_seconds)
        out["single_worker_samples_per_s"] = batch / solo
        out["linearity"] = solo / (step.median / 1e3)
    return out


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _table(report: dict, entries: List[_Entry]) -> str:
    distributed = report["world_size"] > 1
    memory = "peak CUDA MB" if report["mem_kind"] == "cuda" else "peak RSS MB"
    rows = [("contender", "step ms", "p10-p90 ms", "samples/s", memory, "setup s", "speedup",
             "final loss") + (("linearity",) if distributed else ())]
    notes = []
    for e in entries:
        r = report["baseline"] if e.name == "baseline" else report["strategies"][e.name]
        step = r["step_ms"] or {}
        if e.name == "baseline":
            versus = "(ref)"
        elif r["failed"]:
            versus = "failed"
        elif r["stopped"]:
            versus = f"stopped ({r['speedup']:.2f}x)"
        else:
            versus = f"{r['speedup']:.2f}x" + ("" if r["verdict"] in ("faster", "slower") else " ~")
        spread = f"{step['p10']:.1f}-{step['p90']:.1f}" if step else "-"
        rows.append((e.name, _fmt(step.get("median"), ".1f"), spread, _fmt(r["samples_per_s"], ".1f"),
                     _fmt(r["peak_mem_mb"], ".0f"), f"{r['setup_s']:.2f}", versus, _fmt(r["final_loss"], ".4f"))
                    + ((_fmt(r["linearity"], ".2f"),) if distributed else ()))
        if e.name == "baseline":
            continue
        if r["failed"]:
            notes.append(f"  {e.name}: {r['failed']}")
        elif r["stopped"]:
            notes.append(f"  {e.name}: {r['stopped']}")
        else:
            notes.append(f"  {e.name}: {r['describe']}")
        changed = (r.get("decision") or {}).get("changed") or {}
        changed = {k: v for k, v in changed.items() if not k.startswith("tune")}
        if changed:
            notes.append("    applied: " + ", ".join(f"{k}={v}" for k, v in changed.items()))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                              for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    legend = ("  speedup: baseline step / contender step, median of the per-round ratios; '~' = within noise or too "
              "few rounds (see below)")
    if distributed:
        legend += ("\n  linearity: multi-worker throughput / single-worker throughput / workers (single worker: rank "
                   "0 alone, unwrapped)")
    return "\n".join(lines + [legend, ""] + notes)


def _plot(path: str, entries: List[_Entry], warmup: int, title: str) -> None:
    """Step time (ms) against each contender's own step index, warm-up included and shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    highest, lowest = 0.0, float("inf")
    for e in entries:
        if e.failed:
            continue
        ms = [s * 1e3 for s in e.contender.warmup_seconds + e.contender.step_seconds]
        label = e.name + (" (stopped)" if e.contender.stopped else "")
        ax.plot(range(1, len(ms) + 1), ms, marker="o", markersize=3, linewidth=1.2, label=label)
        highest, lowest = max(highest, max(ms)), min(lowest, min(ms))
    if warmup:
        ax.axvspan(0.5, warmup + 0.5, color="0.9", zorder=0, label="warm-up (not timed)")
    if lowest > 0 and highest / lowest > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step (each contender's own; the contenders alternate in rounds)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ the command

def run(args) -> int:
    """``aiak bench``: 0 when every contender ran (a stopped one included), 1 when a strategy failed (its row
    says why), 2 for a mistake in the arguments or a SPEC that cannot train (one line on stderr)."""
    strategies = list(args.strategy or ["auto"])
    problem = _check_arguments(args, strategies) or _load_strategies(strategies)
    if problem:
        return _usage_error(problem)
    try:
        world = _World.join(args.device)
    except _UsageError as e:
        return _usage_error(str(e))
    try:
        return _bench(args, strategies, world)
    except _UsageError as e:
        return _usage_error(str(e)) if world.leader else 2
    except Exception as e:
        from aiak.model_spec import ModelSpecError

        if isinstance(e, ModelSpecError) and not world.leader:
            return 2                          # rank 0 says it once
        raise
    finally:
        world.leave()


def _bench(args, strategies: List[str], world: _World) -> int:
    import warnings

    from aiak.progress import Board

    human = sys.stderr if args.json else sys.stdout
    show = world.leader and not args.no_progress

    def say(line: str) -> None:
        if show:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    if not world.leader:                        # only rank 0 speaks; a failure still raises
        warnings.simplefilter("ignore")
        logging.getLogger("aiak").setLevel(logging.ERROR)
    rounds, per_round, warmup = args.rounds, args.steps // args.rounds, args.warmup
    steps = rounds * per_round
    memory = _Memory(world.device)
    baseline, setup = _baseline(args, world, memory, warmup, steps)
    split = f"{steps} timed steps in {rounds} rounds of {per_round}" + (
        f" ({args.steps} asked: a multiple of --rounds is timed)" if steps != args.steps else "")
    what = ("torch.cuda.max_memory_allocated" if memory.kind == "cuda"
            else "the process RSS, every contender's weights included")
    if world.leader:
        print(f"aiak bench: {setup.description}; device {world.device}"
              + (f", {world.size} workers" if world.size > 1 else "")
              + f"\n  {split} per contender, after {warmup} warm-up steps; peak memory is the whole process's ({what})",
              file=human, flush=True)
    entries = [baseline] + [_strategy(s, args, world, memory, warmup, steps, say) for s in strategies]
    running = [e for e in entries if e.loop is not None]
    try:
        with Board({e.name: warmup + steps for e in running}, enabled=show) as board:
            _time(running, warmup, rounds, per_round, board)
    except Exception as e:
        if baseline.loop.failure is None:
            raise
        raise _UsageError(f"the baseline (plain PyTorch) {baseline.loop.failure}; the model {args.model!r} cannot "
                          f"train as given") from e
    for e in running:                           # a rank that failed alone: every rank drops the contender
        if world.agree_any(bool(e.failed)) and not e.failed:
            e.failure = "failed on another rank (its log says why)"
    alive = [e for e in running if not e.failed and not e.contender.stopped]
    for e in running:
        if e not in alive and (args.trace or world.size > 1):
            say(f"  {e.name}: {'failed' if e.failed else 'stopped'}, so neither traced nor timed alone")
    traces = _trace(alive, args.trace, world, say) if args.trace else {}
    if world.size > 1:
        _single_worker(alive, world, warmup, rounds, per_round, say)
    code = 1 if any(e.failed for e in entries) else 0          # every rank knows: the failures were agreed
    if not world.leader:
        return code

    report = {"model": args.model, "description": setup.description, "device": str(world.device),
              "batch_size": setup.batch_size, "world_size": world.size, "steps": steps, "steps_asked": args.steps,
              "steps_per_round": per_round,
              "warmup": warmup, "rounds": rounds, "mem_kind": memory.kind}
    report["baseline"] = _stats(baseline, baseline, setup.batch_size, world, memory)
    report["strategies"] = {e.name: _stats(e, baseline, setup.batch_size, world, memory) for e in entries[1:]}
    report["speedup"] = report["strategies"][strategies[0]]["speedup"]
    if traces:
        report["traces"] = traces
    print("", file=human)
    print(_table(report, entries), file=human, flush=True)
    if args.plot:
        _plot(args.plot, entries, warmup, setup.description)
        print(f"  plot: {args.plot}", file=human)
    if args.json:
        print(json.dumps(report, default=str), flush=True)
    return code
