"""Measured trials: time candidate strategies on the user's model and first batches, keep the fastest safe one.

How (``tune: {candidates, steps, max_seconds}``; on by default for ``"auto"``):

1. The cache (:mod:`aiak.tune.cache`) is asked first, under :func:`decision_key`; a hit runs no trial.
2. ``tune.steps`` batches are borrowed from the loader (:mod:`aiak.tune.replay`; given back untouched).
3. Each candidate (:mod:`aiak.tune.candidates`) is applied to its own deep copy of the model and optimizer,
   through the same :func:`aiak.api.apply_strategy` as ``optimize()`` (without DDP wrapping and loader
   wrapping, which do not change the step's compute). The user's objects are never touched.
4. Warm-up round: every candidate takes one step on batch 0 from the same weights and RNG state; its
   gradients go through the numerics gate (:mod:`aiak.tune.gate`) against plain fp32's.
5. Timed rounds, alternating candidates (the order rotates every round), one step each, until
   ``tune.steps`` rounds are done or the budget is spent (at least :data:`MIN_TIMED_ROUNDS`, so no decision
   rests on one sample). Default budget: :data:`BUDGET_FRACTION` of :data:`BUDGET_RUN_STEPS` plain steps.
6. The fastest accepted candidate by median step time wins; a simpler candidate (plain PyTorch, then the
   numerics-neutral subset, then the others in preference order) within noise of it is preferred.
7. RNG (torch CPU/CUDA, Python, NumPy, the loader's generator) and process switches are put back as they
   were after the batches were borrowed, so the run that follows is the one the winner would have given
   from step 0 (bit-identical on CPU for a deterministic model).

The trial step is the loop aiak assumes: ``model(batch)`` for a tensor, ``model(batch[0])`` for a tuple or
list, ``model(**batch)`` for a mapping; loss = the output's ``.loss`` (Hugging Face), else cross-entropy
with ``batch[1]`` for 2-D logits and integer labels, else the mean square of the output. The loss only has
to make the step's compute real: the same function is timed for every candidate and gated against fp32.

Distributed (world size > 1): every rank runs the same candidates in the same order; after each round one
all-reduce (MAX) gives every candidate the slowest rank's time and fails a candidate that failed on any
rank (error, OOM, numerics); rank 0 decides and broadcasts. Collectives are the same on every rank.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from aiak._nested import iter_tensors, map_tensors
from aiak.amp import warn as amp_warn
from aiak.strategy.schema import Strategy
from aiak.tune import gate
from aiak.tune.cache import TuneCache
from aiak.tune.candidates import Candidate, candidate_strategies
from aiak.tune.replay import borrow
from aiak.versions import installed_version

BUDGET_FRACTION = 0.05     # the budget: 5% ...
BUDGET_RUN_STEPS = 200     # ... of a 200-step run at plain PyTorch's speed
MIN_TIMED_ROUNDS = 2
NOISE_FLOOR = 0.03         # step times closer than 3% are never told apart


@dataclass
class TrialRecord:
    """One candidate's result, as ``last_decision().to_dict()["trials"]`` shows it."""

    label: str
    strategy: Dict[str, Any]                    # key path -> value where it differs from plain PyTorch
    step_ms: Optional[float] = None             # median of the timed rounds (slowest rank)
    step_ms_spread: Optional[List[float]] = None  # [min, max] of the timed rounds
    samples_ms: List[float] = field(default_factory=list)
    peak_mem_mb: Optional[float] = None         # CUDA only (max allocated during the warm-up step)
    grad_cosine: Optional[float] = None
    grad_norm_diff: Optional[float] = None
    accepted: bool = False
    why: str = ""

    speedup: Optional[float] = None             # median (low) over rounds of plain's time / this one's, same round
    speedup_spread: Optional[List[float]] = None  # [min, max] of those per-round ratios

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Tuning:
    """What the trials decided, and the loader to hand on (the borrowed batches put back)."""

    strategy: Strategy
    label: str
    trials: List[TrialRecord]
    seconds: float
    cache_hit: bool
    loader: Any
    skipped: str = ""                           # why no trial ran (empty when they ran or the cache answered)
    restore_rng: Any = None                     # puts the RNG back as it was before borrowing (on failure)


# -- RNG ------------------------------------------------------------------------------------------
class _Rng:
    """Every random stream a training step or a loader may draw from."""

    def __init__(self, loader: Any, cuda: bool):
        self.cuda = cuda
        self.torch = torch.get_rng_state()
        self.cuda_states = torch.cuda.get_rng_state_all() if cuda else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None
        self.generators = list({id(g): g for g in _generators(loader)}.values())
        self.generator_states = [g.get_state() for g in self.generators]

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda_states is not None:
            torch.cuda.set_rng_state_all(self.cuda_states)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        for g, state in zip(self.generators, self.generator_states):
            g.set_state(state)


def _generators(loader: Any) -> List[torch.Generator]:
    out = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            out.append(g)
    return out


# -- the cache key --------------------------------------------------------------------------------
def model_structure(model: nn.Module) -> str:
    """sha1 of every module's name and class, and every parameter's and buffer's name, shape and dtype."""
    h = hashlib.sha1()
    for name, m in model.named_modules():
        h.update(f"{name}:{type(m).__module__}.{type(m).__qualname__};".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    return h.hexdigest()


def batch_signature(loader: Any) -> Optional[str]:
    """Batch size and the shapes/dtypes of one sample (``dataset[0]``, RNG untouched), or None if unknown."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__"):
        return None
    rng = _Rng(loader, cuda=False)
    try:
        sample = dataset[0]
    except Exception:
        return None
    finally:
        rng.restore()
    shapes = [(tuple(t.shape), str(t.dtype)) for t in iter_tensors(sample)]
    return f"batch={getattr(loader, 'batch_size', None)}:{shapes}:{type(sample).__name__}"


def decision_key(model: nn.Module, optimizer: Any, loader: Any, probes: Any, profiles_digest: str,
                 tune_cfg: Any) -> Optional[str]:
    """The cache key of a tuning decision, or None when the batch shape cannot be known without drawing."""
    batch = batch_signature(loader)
    if batch is None:
        return None
    p = probes.to_dict() if hasattr(probes, "to_dict") else {}
    hardware = {k: p.get(k) for k in ("device", "cuda", "cpu_model", "cpu_features", "cpu_cores", "world_size",
                                      "local_size", "nodes", "backend")}
    parts = {"model": model_structure(model), "batch": batch, "hardware": hardware,
             "optimizer": type(optimizer).__name__, "torch": torch.__version__, "triton": installed_version("triton") or "none",
             "aiak": installed_version("aiak") or "none", "profiles": profiles_digest,
             "tune": [tune_cfg.candidates, tune_cfg.steps, tune_cfg.max_seconds]}
    digest = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"strategy|{type(model).__name__}|{digest[:24]}"


# -- one trial step -------------------------------------------------------------------------------
def trial_loss(output: Any, batch: Any) -> torch.Tensor:
    """The loss the trial step backpropagates (see the module docstring); class scores are read by
    :func:`aiak.model_spec.logits_of`, the one reading of a model's output."""
    from aiak.model_spec import logits_of

    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss.float()
    try:
        logits = logits_of(output)
    except TypeError:  # no class scores (a backbone's features): any floating output makes the compute real
        logits = next(t for t in iter_tensors(output) if t.is_floating_point())
    target = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
    if (isinstance(target, torch.Tensor) and logits.dim() == 2 and target.dim() == 1
            and not target.is_floating_point() and target.shape[0] == logits.shape[0]):
        return nn.functional.cross_entropy(logits.float(), target.to(logits.device))
    return logits.float().square().mean()


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)) and batch:
        return model(batch[0])
    raise TypeError(f"trial step: cannot feed a batch of type {type(batch).__name__} to the model")


class _Contender:
    """A candidate applied to its own copy of the model and optimizer."""

    def __init__(self, candidate: Candidate, device: torch.device):
        self.candidate = candidate
        self.record = TrialRecord(candidate.label, {k: _plain(v) for k, v in candidate.changes.items()})
        self.device = device
        self.channels_last = candidate.strategy.channels_last and candidate.strategy.loader.prefetch > 0
        self.failed = ""

    def build(self, model: nn.Module, optimizer: Any) -> None:
        """Apply the candidate to deep copies of ``model`` and ``optimizer`` (quietly; failures are recorded)."""
        from aiak.api import apply_strategy

        try:
            with amp_warn.quiet():
                self.bare, optimizer = copy.deepcopy((model, optimizer))
                applied = apply_strategy(self.candidate.strategy, self.bare, optimizer, None, None, self.device,
                                         distributed=False)
            self.model, self.optimizer, self.controller = applied.model, applied.optimizer, applied.controller
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be applied is dropped, not fatal
            self.fail(f"could not be applied: {_describe(e)}")

    def fail(self, why: str) -> None:
        self.failed = self.failed or why
        self.record.why = self.failed
        self.record.accepted = False

    def switches(self) -> None:
        from aiak import amp

        s = self.candidate.strategy
        amp.apply_tf32(s.tf32, self.device)
        amp.apply_cudnn_benchmark(s.cudnn_benchmark, self.device)

    def prepare(self, batch: Any) -> Any:
        """The batch as this candidate's loader would deliver it (device, and channels_last when prefetched)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.device, copy=True)
            if self.channels_last and t.dim() == 4 and t.is_floating_point():
                t = t.contiguous(memory_format=torch.channels_last)
            return t
        return map_tensors(batch, move)

    def step(self, batch: Any, want_grads: bool) -> Optional[Dict[str, torch.Tensor]]:
        batch = self.prepare(batch)
        loss = trial_loss(_call(self.model, batch), batch)
        loss.backward()
        grads = None
        if want_grads:  # one micro-step's true gradient: the fp32 parameters' own, unscaled inside the graph
            grads = gate.gradients(self.bare)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return grads


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else json.loads(json.dumps(value, default=str))


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


# -- the trials -----------------------------------------------------------------------------------
def run_trials(selection: Any, model: nn.Module, optimizer: Any, loader: Any, device: torch.device,
               *, cache: Optional[TuneCache] = None) -> Tuning:
    """Tune ``selection.strategy`` on the user's objects (left untouched); see the module docstring."""
    pick: Strategy = selection.strategy
    cfg = pick.tune
    start = time.perf_counter()
    if model is None or optimizer is None or loader is None:
        return Tuning(pick, pick.name, [], 0.0, False, loader,
                      skipped="trials need a model, an optimizer and a loader; the rules' pick is used as is")
    if pick.loader.balanced:
        return Tuning(pick, pick.name, [], 0.0, False, loader,
                      skipped="loader.balanced rebuilds the loader's sampling, so its first batches cannot be "
                              "borrowed and replayed; the rules' pick is used as is")
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
    cache = cache if cache is not None else TuneCache()
    key = decision_key(model, optimizer, loader, selection.probes, selection.profiles_digest, cfg)
    hit = _shared_lookup(cache, key, group)
    if hit is not None:
        try:
            strategy = Strategy.from_dict(hit["strategy"], source=f"{cache.path} [{key}]")
            trials = [TrialRecord(**t) for t in hit.get("trials", [])]
            return Tuning(strategy, hit.get("label", strategy.name), trials, time.perf_counter() - start, True, loader)
        except Exception:  # a stale or malformed entry: tune again and overwrite it
            pass

    from aiak.loaders.prefetch import PrefetchLoader
    from aiak.rollback import Snapshot

    source = loader.loader if isinstance(loader, PrefetchLoader) else loader
    cuda = device.type == "cuda"
    before = _Rng(source, cuda)
    batches, replay = borrow(source, max(cfg.steps, 1))
    after = _Rng(source, cuda)
    if not batches:
        return Tuning(pick, pick.name, [], time.perf_counter() - start, False, replay,
                      skipped="the loader gave no batch", restore_rng=before.restore)
    switches = Snapshot()
    try:
        candidates = candidate_strategies(pick, selection.probes, limit=cfg.candidates, max_seconds=cfg.max_seconds)
        contenders = _build(candidates, model, optimizer, device, group)
        _warm_up(contenders, batches, after, device, group)
        _timed_rounds(contenders, batches, cfg, start, group)
        winner = _decide(contenders, group)
    except Exception as e:  # noqa: BLE001 - a bug in tuning must not cost the user's run: use the rules' pick
        return Tuning(pick, pick.name, [], time.perf_counter() - start, False, replay,
                      skipped=f"trials failed ({_describe(e)}); the rules' pick is used as is",
                      restore_rng=before.restore)
    finally:
        switches.restore()
        after.restore()
    trials = [c.record for c in contenders]
    seconds = time.perf_counter() - start
    if key is not None and (group is None or dist.get_rank(group) == 0):
        cache.put_entry(key, {"kind": "strategy", "label": winner.candidate.label,
                              "strategy": winner.candidate.strategy.to_dict(),
                              "trials": [t.to_dict() for t in trials], "tuning_seconds": seconds})
    return Tuning(winner.candidate.strategy, winner.candidate.label, trials, seconds, False, replay,
                  restore_rng=before.restore)


def _shared_lookup(cache: TuneCache, key: Optional[str], group) -> Optional[dict]:
    """Rank 0 reads the cache and broadcasts the entry (every rank calls this, with or without a key)."""
    if group is None:
        return cache.get_entry(key) if key is not None else None
    from aiak.comm.autotune import group_device

    box = [cache.get_entry(key) if dist.get_rank(group) == 0 and key is not None else None]
    dist.broadcast_object_list(box, src=0, group=group, device=group_device(group))
    return box[0]


def _reduce_max(values: List[float], group) -> List[float]:
    if group is None:
        return values
    from aiak.comm.autotune import group_device

    t = torch.tensor(values, dtype=torch.float64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _build(candidates: List[Candidate], model, optimizer, device, group) -> List[_Contender]:
    built = [_Contender(c, device) for c in candidates]
    for b in built:
        b.build(model, optimizer)
    flags = _reduce_max([1.0 if b.failed else 0.0 for b in built], group)
    for b, flag in zip(built, flags):
        if flag:
            b.fail("could not be applied on another rank")
    return built


def _warm_up(contenders: List[_Contender], batches, rng: _Rng, device, group) -> None:
    """One step each on batch 0 from the same RNG state; gradients gated against plain fp32's."""
    grads: Dict[int, Dict[str, torch.Tensor]] = {}
    for c in sorted(contenders, key=lambda c: c.candidate.label != "plain"):  # plain first: the reference
        if c.failed:
            continue
        rng.restore()
        try:
            with amp_warn.quiet():
                c.switches()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                grads[id(c)] = c.step(batches[0], want_grads=True)
                if device.type == "cuda":
                    c.record.peak_mem_mb = torch.cuda.max_memory_allocated(device) / 2**20
        except Exception as e:  # noqa: BLE001 - error or OOM: this candidate is dropped on every rank
            c.fail(_describe(e))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    reference = next((grads.get(id(c)) for c in contenders if c.candidate.label == "plain"), None)
    packed = []  # per contender: failed, -cosine, norm difference, non-finite; max-reduced over ranks
    for c in contenders:
        result = gate.compare(grads[id(c)], reference) if not c.failed and reference is not None else None
        packed += [1.0 if c.failed else 0.0,
                   -(result.cosine if result and result.finite else -1.0),
                   result.norm_diff if result and result.finite else float("inf"),
                   0.0 if result is None or result.finite else 1.0]
    reduced = _reduce_max(packed, group)
    for i, c in enumerate(contenders):
        failed, neg_cos, norm_diff, nonfinite = reduced[4 * i:4 * i + 4]
        if failed:
            c.fail("failed on another rank")
            continue
        result = gate.GateResult(-neg_cos, norm_diff, not nonfinite)
        c.record.grad_cosine, c.record.grad_norm_diff = result.cosine, result.norm_diff
        if c.candidate.label == "plain":
            c.record.why = "plain PyTorch: the fp32 reference"
        elif c.candidate.neutral:
            c.record.why = "numerics-neutral: no gate needed"
        elif reference is None:
            c.fail("no fp32 reference to gate against (plain PyTorch failed)")
        elif not result.passed:
            c.fail(result.why())
        else:
            c.record.why = result.why()


def _timed_rounds(contenders: List[_Contender], batches, cfg, start: float, group) -> None:
    """Rounds of one step per candidate (order rotating), until ``cfg.steps`` rounds or the budget is spent."""
    from aiak.comm.autotune import StepClock

    active = [c for c in contenders if not c.failed]
    budget, previous = cfg.max_seconds, None
    for r in range(max(cfg.steps, MIN_TIMED_ROUNDS)):
        shift = r % max(len(active), 1)
        seconds: Dict[int, float] = {}
        for c in active[shift:] + active[:shift]:
            clock = StepClock(c.device)
            try:
                with amp_warn.quiet():
                    c.switches()
                    t0 = clock.mark()
                    c.step(batches[(r + 1) % len(batches)], want_grads=False)
                    seconds[id(c)] = clock.seconds(t0, clock.mark())
            except Exception as e:  # noqa: BLE001
                c.fail(_describe(e))
                seconds[id(c)] = float("inf")
        reduced = _reduce_max([seconds[id(c)] for c in active] + [time.perf_counter() - start], group)
        for c, t in zip(active, reduced[:-1]):
            if t == float("inf"):
                c.fail("failed on another rank")
            else:
                c.record.samples_ms.append(t * 1e3)
        active = [c for c in active if not c.failed]
        elapsed = reduced[-1]
        round_seconds, previous = elapsed - (previous if previous is not None else elapsed), elapsed
        if budget is None:  # default: 5% of a 200-step run at plain PyTorch's speed
            plain = next((c for c in active if c.candidate.label == "plain"), None)
            if plain is not None:
                budget = BUDGET_FRACTION * BUDGET_RUN_STEPS * min(plain.record.samples_ms) / 1e3
        done = r + 1
        if done >= MIN_TIMED_ROUNDS and (done >= cfg.steps or budget is None or elapsed + round_seconds > budget):
            break
    plain = next((c for c in contenders if c.candidate.label == "plain" and not c.failed), None)
    for c in contenders:
        s = c.record.samples_ms
        if s and not c.failed:
            c.record.step_ms = statistics.median(s)
            c.record.step_ms_spread = [min(s), max(s)]
            if plain is not None and len(plain.record.samples_ms) == len(s):
                ratios = [p / t for p, t in zip(plain.record.samples_ms, s)]
                c.record.speedup = statistics.median_low(ratios)  # of an even count, the lower: conservative
                c.record.speedup_spread = [min(ratios), max(ratios)]


def _simplicity(c: _Contender) -> int:
    return 0 if c.candidate.label == "plain" else 1 if c.candidate.neutral else 2


def _noise(record: TrialRecord) -> float:
    """Half the range of a candidate's per-round speedups, relative to their median (at least NOISE_FLOOR)."""
    low, high = record.speedup_spread or (0.0, float("inf"))
    return max((high - low) / (2 * record.speedup), NOISE_FLOOR) if record.speedup else float("inf")


def _decide(contenders: List[_Contender], group) -> _Contender:
    """The fastest accepted candidate, by the median of its per-round speedups over plain PyTorch (each round
    runs every candidate back to back, so a ratio within a round cancels the machine's slow drifts); a
    simpler candidate (plain, then numerics-neutral) whose speedup is within noise of the best is preferred.
    Rank 0 decides and broadcasts (all ranks hold the same max-reduced times anyway)."""
    accepted = [c for c in contenders if not c.failed and c.record.speedup is not None]
    for c in accepted:
        c.record.accepted = True
    index = next(i for i, c in enumerate(contenders) if c.candidate.label == "plain")
    if accepted and (group is None or dist.get_rank(group) == 0):
        best = max(accepted, key=lambda c: c.record.speedup)
        winner = best
        for c in sorted(accepted, key=_simplicity):
            if _simplicity(c) >= _simplicity(best):
                break
            noise = max(_noise(c.record), _noise(best.record))
            if c.record.speedup >= best.record.speedup / (1 + noise):
                winner = c
                break
        index = contenders.index(winner)
    if group is not None:
        from aiak.comm.autotune import group_device

        t = torch.tensor([index], dtype=torch.int64, device=group_device(group))
        dist.broadcast(t, src=0, group=group)
        index = int(t)
    winner = contenders[index]
    for c in accepted:
        tail = f"{c.record.speedup:.2f}x plain (rounds {c.record.speedup_spread[0]:.2f}-{c.record.speedup_spread[1]:.2f})"
        c.record.why = f"{c.record.why}; {tail}" + ("; chosen" if c is winner else "")
    return winner
