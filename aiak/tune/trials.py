"""Measured trials: time candidate strategies on the user's model and first batches, keep the fastest safe one.

How (``tune: {candidates, steps, max_seconds}``; on by default for ``"auto"``):

1. The cache (`aiak.util.cache`) is asked first, under `decision_key`; a hit runs no trial.
2. ``tune.steps`` batches are borrowed from the loader (`aiak.tune.replay`; given back untouched).
3. Each candidate (`aiak.tune.candidates`) is applied to its own deep copy of the model and optimizer,
   through the same `aiak.apply.apply_strategy` as ``optimize()`` (without DDP wrapping and loader
   wrapping, which do not change the step's compute). The user's objects are never touched. Where the run
   will time the candidates (step 5), the pick alone is applied to one copy, and each candidate is that copy
   switched between passes (`SwitchedRun`), its gate step a gradient that changes nothing of the copy.
4. Warm-up round: every candidate takes one step on batch 0 from the same weights and RNG state; the
   gradients of each one that changes the numerics (not plain, not a numerics-neutral one) go through the
   numerics gate (`aiak.tune.gate`) against plain fp32's, their error judged against the sampling noise of
   that gradient. Plain estimates the noise first, from the same weights, only when some candidate needs the
   gate: one more fp32 gradient, of batch 1 (or of the two halves of batch 0 when only one batch was
   borrowed). Then each evaluates as a script does between epochs (``model.eval()``, a forward of two samples
   under ``torch.inference_mode()``, ``model.train()``): a candidate whose evaluation fails where plain
   PyTorch's runs is rejected, with the error in its record. On the pick's one copy (step 3), a candidate that
   differs from an earlier one only in the precision level and whose forward gives that one's outputs bit for bit
   computes as it does (`_level_twins`): no backward, and it is dropped with that reason, neither evaluated nor
   timed.
5. Where the run can time them instead (`_timed_in_run`: every candidate is the pick's model switched between
   steps, `aiak.tune.candidates.switches_between_steps`, and the run-time guard can watch), no round runs here:
   the pick is applied and its guard (`aiak.tune.guard`) times the accepted candidates against plain compute in
   the run's first steps, which train the run. Otherwise, rounds: every candidate takes one step per round, the
   order rotating every round; its steps form one series, the gate's step first. A new copy's first steps pay one-time costs (the allocator growing, oneDNN
   creating primitives, cuDNN autotuning): in timm's script a trial's plain step took 3.75 s where the real
   run's took 0.33 s. Timing starts where every series has settled (its last two steps no faster than its
   best before them, within `SETTLE_TOLERANCE`), or after `WARMUP_MAX_STEPS` steps, or when the
   budget runs out: those two steps are the first timed samples (`MIN_TIMED_ROUNDS`), so a candidate
   that needs no warm-up costs three steps in all.
6. Timed rounds go on until ``tune.steps`` samples, the budget is spent, or the ranking is clear (each
   candidate faster than plain in every timed round or slower in every one, beyond `NOISE_FLOOR`, and
   the fastest ahead of each other one in every round). Default budget: `BUDGET_FRACTION` of
   `BUDGET_RUN_STEPS` plain steps.
   Every step, warm-up included, runs under its candidate's own process switches (TF32, cuDNN autotuning,
   CPU affinity, threads: what applying it set), all written before the step, on or off, so no candidate
   inherits another's, and plain fp32, the gate's reference, none.
7. After rounds, the fastest accepted candidate by median step time wins; a simpler candidate (plain PyTorch, then the
   numerics-neutral subset, then the others in preference order) within noise of it is preferred.
8. RNG (torch CPU/CUDA, Python, NumPy, the loader's generators) and process switches are put back as they
   were before the batches were borrowed, so ``optimize()`` returns with every random stream as it found it.
   The replay loader gives the borrowed batches back at the loop's first iteration only if the script left
   the streams and the sampler's epoch alone (it then moves the streams on as drawing them did), and opens
   the loader afresh otherwise (a reseed or ``set_epoch`` before the loop, augmentation drawing in this
   process). So the run that follows is the one the winner would have given from step 0 (bit-identical on
   CPU for a deterministic model).

The trial step is the loop aiak assumes: ``model(batch)`` for a tensor, ``model(batch[0])`` for a tuple or
list, ``model(**batch)`` for a mapping; loss = the output's ``.loss`` (Hugging Face), else cross-entropy
with ``batch[1]`` where it is a class index for the output (an integer tensor of the scores' shape without
the class dimension, every value in [0, classes) or the ignore index), else the mean square of the output,
which is valid for any floating output (regression targets, sample indices, masks of another shape). The
loss only has to make the step's compute real: the same function is timed for every candidate and gated
against fp32. When no candidate is accepted (plain PyTorch itself failed: the trial step cannot run this
model on these batches), nothing was measured: the rules' pick is used as is, and the decision record says
so with plain's error instead of naming a winner.

Distributed (world size > 1): every rank runs the same candidates in the same order; after each round one
all-reduce (MAX) gives every candidate the slowest rank's time and fails a candidate that failed on any
rank (error, OOM, numerics); rank 0 decides and broadcasts. Collectives are the same on every rank.
"""
from __future__ import annotations

import hashlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from aiak.loaders.prefetch import PrefetchLoader
from aiak.measure.clock import StepClock
from aiak.measure.memory import PeakMemory
from aiak.measure.rounds import Contender, alternate, ranking_is_clear
from aiak.measure.thresholds import NOISE_FLOOR
from aiak.ops.surgery import SWITCHED_OPS, FusedOpsSwitch
from aiak.runtime.rollback import Snapshot
from aiak.runtime.switches import read_switches, with_memory_switches
from aiak.strategy.schema import Strategy
from aiak.tune import gate
from aiak.tune.guard import PICK, PLAIN as PLAIN_COMPUTE, Arm, not_watched
from aiak.tune.candidates import (Candidate, candidate_strategies, differences, switches_between_steps,
                                  with_picks_knobs)
from aiak.tune.replay import RandomStreams, borrow
from aiak.tune.trial_run import SwitchedRun, TrialRecord, TrialRun, batch_rows, batch_size_of
from aiak.util import warn
from aiak.util.cache import TuneCache
from aiak.util.dist import max_across_ranks, on_rank0, rank0_index, rank0_object
from aiak.util.nested import iter_tensors
from aiak.util.status_line import StatusLine
from aiak.util.text import describe_error
from aiak.util.machine.load import CpuLoad, cpu_load
from aiak.util.machine.versions import installed_version

BUDGET_FRACTION = 0.05     # the trials' budget: 5% ...
BUDGET_RUN_STEPS = 200     # ... of a 200-step run at plain PyTorch's speed
MIN_TIMED_ROUNDS = 2
WARMUP_MAX_STEPS = 6       # steps per candidate before timing starts at the latest (the gate's included) ...
SETTLE_TOLERANCE = 0.2     # ... until they stop getting faster by more than 20% (first-call costs: multiples)


@dataclass
class Tuning:
    """What the trials decided, and the loader to hand on (the borrowed batches put back)."""

    strategy: Strategy
    label: str
    trials: List[TrialRecord]
    seconds: float
    cache_hit: bool
    loader: Any
    skipped: str = ""                           # why nothing was measured: no trial ran, or every candidate
                                                # failed (empty when the trials or the cache decided)
    restore_rng: Any = None                     # puts the RNG back as it was before borrowing (on failure)
    key: Optional[str] = None                   # the cache key of this decision (None: not cacheable)
    cache: Optional[TuneCache] = None
    remeasured: str = ""                        # why a cached decision was not reused (the load differed)
    arms: List[Arm] = field(default_factory=list)  # candidates the run-time guard times beside the pick (in the run)
    prefer: List[str] = field(default_factory=list)  # the guard's preference within noise (`aiak.tune.guard.choose`)

    def learn(self, guard: Dict[str, Any]) -> None:
        """Keep the run-time guard's choice (`aiak.tune.guard`) in this decision's cache entry, beside the load it
        was measured under: a later run under that load starts from it."""
        if self.key is None or self.cache is None or not on_rank0():
            return
        entry = self.cache.get_entry(self.key)
        if entry is not None:
            entry["guard"] = guard
            self.cache.put_entry(self.key, entry)


# -- RNG ------------------------------------------------------------------------------------------
_Rng = RandomStreams  # every random stream a training step or a loader may draw from (aiak.tune.replay)


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
    return TuneCache.key("strategy", type(model).__name__, digest_of=parts)


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
    cache = cache if cache is not None else TuneCache()
    key = decision_key(model, optimizer, loader, selection.probes, selection.profiles_digest, cfg)
    hit = rank0_object(lambda: cache.get_entry(key) if key is not None else None)
    load = cpu_load() if device.type == "cpu" else None
    remeasured = load_changed(hit, load) if hit is not None else ""
    if hit is not None and not remeasured and hit.get("timed_in_run") and "speedups" not in (hit.get("guard") or {}):
        remeasured = "the cached decision's timing in the run did not finish: measured again"
    if hit is not None and not remeasured:
        try:
            guard = hit.get("guard") or {}
            arms = hit.get("arms") or {}
            chosen = (hit["plain_strategy"] if guard.get("chosen") == PLAIN_COMPUTE
                      else arms[guard["chosen"]] if guard.get("chosen") in arms else hit["strategy"])
            # what the trials may not change is the pick's, also in an entry written before that rule held
            strategy = Strategy.from_dict(with_picks_knobs(chosen, pick), source=f"{cache.path} [{key}]")
            trials = [TrialRecord(**t) for t in hit.get("trials", [])]
            label = ("plain" if guard.get("chosen") == PLAIN_COMPUTE else guard["chosen"] if guard.get("chosen") in arms
                     else hit.get("label", strategy.name))
            return Tuning(strategy, label, trials, time.perf_counter() - start, True, loader, key=key, cache=cache)
        except Exception:  # a stale or malformed entry: tune again and overwrite it
            pass

    source = loader.loader if isinstance(loader, PrefetchLoader) else loader
    cuda = device.type == "cuda"
    batches, replay = borrow(source, max(cfg.steps, 1), cuda=cuda)
    before, after = replay.opened, replay.drawn   # the streams as the trials found them; as the borrowing left them
    if isinstance(loader, PrefetchLoader):  # the script's own prefetcher: trials see what it yields, and it stays
        batches, replay = [loader.prepare(b) for b in batches], loader.around(replay)
    if not batches:
        before.restore()
        return Tuning(pick, pick.name, [], time.perf_counter() - start, False, replay,
                      skipped="the loader gave no batch", restore_rng=before.restore)
    switches = Snapshot()
    try:
        candidates = candidate_strategies(pick, selection.probes, limit=cfg.candidates, max_seconds=cfg.max_seconds)
        with StatusLine(f"timing {len(candidates)} candidate strategies on the first batches") as status:
            in_run = _timed_in_run(candidates, pick, optimizer)
            contenders = (_build_switched if in_run else _build)(candidates, model, optimizer, device)
            _warm_up(contenders, batches, after, device, status)
            if in_run and any(c.failed for c in contenders if c is contenders[0] or c.candidate.label == "plain"):
                in_run = False   # the pick or plain failed: time the others on copies of their own
                contenders = _build(candidates, model, optimizer, device)
                _warm_up(contenders, batches, after, device, status)
            if not in_run:
                _timed_rounds(contenders, batches, cfg, start, status)
        winner = _start_in_run(contenders) if in_run else _decide(contenders)
    except Exception as e:  # noqa: BLE001 - a bug in tuning must not cost the user's run: use the rules' pick
        return Tuning(pick, pick.name, [], time.perf_counter() - start, False, replay,
                      skipped=f"trials failed ({describe_error(e)}); the rules' pick is used as is",
                      restore_rng=before.restore)
    finally:  # the streams as the trials found them: the replay loader moves them on as the loop draws
        switches.restore()
        before.restore()
    trials = [c.record for c in contenders]
    seconds = time.perf_counter() - start
    arms = [(_arm(c), c) for c in contenders[1:] if in_run and c.record.accepted and c.candidate.label != "plain"]
    if not winner.record.accepted:  # plain PyTorch itself could not be measured: the trials tell nothing
        # Nothing unverified is applied: plain PyTorch compute (the pick's knobs that keep the training the same
        # model stay, as in every candidate). The first error is usually the script's own: say it.
        reference = next(c for c in contenders if c.candidate.label == "plain")
        warn.warn(f"aiak: every candidate failed its trial step on the loader's first batches, plain PyTorch "
                      f"too: {reference.record.why}. That is usually an error of the training script itself (the "
                      f"trials run its model on its own batches); aiak applies plain PyTorch compute, nothing it "
                      f"could not verify")
        return Tuning(reference.candidate.strategy, "plain", trials, seconds, False, replay,
                      restore_rng=before.restore,
                      skipped=f"every candidate failed in the trials, so nothing was measured (plain PyTorch: "
                              f"{reference.record.why}); plain PyTorch compute is applied, nothing unverified")
    if key is not None and on_rank0():
        plain = next(c for c in contenders if c.candidate.label == "plain")
        cache.put_entry(key, {"kind": "strategy", "label": winner.candidate.label,
                              "strategy": winner.candidate.strategy.to_dict(),
                              "plain_strategy": plain.candidate.strategy.to_dict(),
                              "timed_in_run": in_run,
                              "arms": {a.label: c.candidate.strategy.to_dict() for a, c in arms},
                              "load": load.to_dict() if load is not None else None,
                              "trials": [t.to_dict() for t in trials], "tuning_seconds": seconds})
    return Tuning(winner.candidate.strategy, winner.candidate.label, trials, seconds, False, replay,
                  restore_rng=before.restore, key=key, cache=cache, remeasured=remeasured,
                  arms=[a for a, _ in arms], prefer=_preference(contenders) if in_run else [])


def load_changed(entry: Dict[str, Any], load: Optional[CpuLoad]) -> str:
    """Why a cached decision should be measured again: the cores other work leaves free now differ from those it
    was measured under (the guard's reading when it ran, else the trials'), by a reading of other work's runnable
    tasks at least one task away; "" when they match or are unknown."""
    then = (entry.get("guard") or {}).get("load") or entry.get("load")
    if load is None or not load.known or not then or then.get("free_cores") is None:
        return ""
    if then["free_cores"] == load.free_cores:
        return ""
    if then.get("busy_elsewhere") is not None and abs(then["busy_elsewhere"] - load.busy_elsewhere) < 1:
        return ""   # 0.4 busy tasks then and 0.6 now round to other free cores, and are the same load
    return (f"the cached decision was measured with {then['free_cores']} of {then.get('cores')} core(s) free of "
            f"other work, {load.free_cores} now: measured again")


def _build(candidates: List[Candidate], model, optimizer, device) -> List[TrialRun]:
    built = [TrialRun(c, device) for c in candidates]
    for b in built:
        b.build(model, optimizer)
    return _agreed(built)


def _agreed(built: List[TrialRun]) -> List[TrialRun]:
    """``built``, each failed on every rank where it failed to be applied on one."""
    flags = max_across_ranks([1.0 if b.failed else 0.0 for b in built])
    for b, flag in zip(built, flags):
        if flag:
            b.fail("could not be applied on another rank")
    return built


def _build_switched(candidates: List[Candidate], model, optimizer, device) -> List[TrialRun]:
    """The pick built on one copy (`TrialRun.build`), every candidate a `SwitchedRun` of it: plain PyTorch's with the
    process switches as the script has them (but for the memory switches, the pick's: `with_memory_switches`), the
    others with the pick's."""
    script = read_switches()
    shared = TrialRun(candidates[0], device)
    shared.build(model, optimizer)
    shared.fused = FusedOpsSwitch(shared.bare) if not shared.failed else None   # the pick's swapped modules
    plain = with_memory_switches(script, shared.process_switches)
    return _agreed([SwitchedRun(c, device, shared, plain if c.label == "plain" else shared.process_switches)
                    for c in candidates])


def _warm_up(contenders: List[TrialRun], batches, rng: _Rng, device, status: Optional[StatusLine] = None) -> None:
    """One timed step each on batch 0 from the same RNG state; gradients gated against plain fp32's, their error
    judged against its sampling noise (estimated by plain first, only when a candidate needs the gate)."""
    plain = next((c for c in contenders if c.candidate.label == "plain" and not c.failed), None)

    def needs_gate(c: TrialRun) -> bool:  # plain is the reference; a numerics-neutral candidate is not judged
        return c is not plain and not c.candidate.neutral

    gated = any(not c.failed and needs_gate(c) for c in contenders)
    grads: Dict[int, Dict[str, torch.Tensor]] = {}
    seconds: Dict[int, float] = {}
    evaluation: Dict[int, str] = {}  # the error of each one's evaluation forward, "" when it ran
    same: Dict[int, TrialRun] = {}   # a candidate that computes as an earlier one does (`_level_twins`)
    noise_samples: List[Tuple[Dict[str, torch.Tensor], int]] = []
    # plain last: on the pick's one copy (`SwitchedRun`) the others keep the pick's layout, and plain's is one switch
    for c in sorted(contenders, key=lambda c: c is plain):
        if c.failed:
            continue
        if status is not None:
            status.update(f"first step of {c.candidate.label!r}")
        try:
            with warn.quiet():
                c.switches()
                if c is plain and gated:  # before its step: the same weights as every candidate's gate step
                    rng.restore()
                    noise_samples = _noise_samples(plain, batches)
                rng.restore()
                clock = StepClock(device)
                want = gated and (c is plain or needs_gate(c))
                twins = _level_twins(c, [o for o in contenders if o is not c and not o.failed]) if want else []
                with PeakMemory(device) as peak:
                    t0 = clock.mark()
                    if twins:   # where its forward gives a twin's outputs, no backward (`_level_twins`)
                        grads[id(c)] = c.step(batches[0], want_grads=True,
                                              unless=lambda outputs: _same_outputs(outputs, twins) is not None)
                        if grads[id(c)] is None:
                            same[id(c)] = _same_outputs(c.outputs, twins)
                    else:
                        grads[id(c)] = c.step(batches[0], want_grads=want)
                    seconds[id(c)] = clock.seconds(t0, clock.mark())
                c.record.peak_mem_mb = peak.mib
                if c is not plain and id(c) not in same:   # plain's own only where a candidate's fails (below)
                    evaluation[id(c)] = c.evaluate(batches[0])
        except Exception as e:  # noqa: BLE001 - error or OOM: this candidate is dropped on every rank
            c.fail(describe_error(e))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    failing = [c for c in contenders if not c.failed and evaluation.get(id(c))]
    if plain is not None and failing:
        with warn.quiet():
            plain.switches()
            if not plain.evaluate(batches[0]):   # plain PyTorch evaluates so: the script does, and they cannot
                for c in failing:
                    c.fail(f"evaluation (model.eval(), a forward under torch.inference_mode()) failed: "
                           f"{evaluation[id(c)]}")
    reference = grads.get(id(plain)) if plain is not None else None
    noise = _sampling_noise(reference, noise_samples, batches[0])
    results: Dict[int, gate.GateResult] = {}
    packed = []  # per contender: failed, step seconds, the gate's numbers; max-reduced over ranks
    norms = gate.squared_norms(reference) if reference is not None and gated else None   # once for every candidate
    for c in contenders:
        if not c.failed and reference is not None and needs_gate(c):   # a twin's results are its twin's
            twin = same.get(id(c))
            if twin is None:
                results[id(c)] = gate.compare(grads[id(c)], reference, noise, norms)
            elif id(twin) in results:
                results[id(c)] = results[id(twin)]
        result = results.get(id(c), gate.GateResult(True, "", None, 1.0, 1.0, 0.0))  # failed, or no reference
        packed += [1.0 if c.failed else 0.0, seconds.get(id(c), 0.0)] + result.numbers()
    width = len(packed) // max(len(contenders), 1)
    reduced = max_across_ranks(packed)
    rows = [reduced[width * i:width * (i + 1)] for i in range(len(contenders))]
    for c, (failed, *_) in zip(contenders, rows):
        if failed:
            c.fail("failed on another rank")
    has_reference = plain is not None and not plain.failed  # on every rank
    for c, (_, step_s, *numbers) in zip(contenders, rows):
        if c.failed:
            continue
        c.warmup_s.append(step_s)
        local = results.get(id(c))
        result = gate.GateResult.from_numbers(numbers, lost=local.lost if local is not None else "")
        if has_reference and needs_gate(c):
            c.record.grad_cosine, c.record.grad_norm_diff = result.cosine, result.norm_diff
        if id(c) in same:
            twin = same[id(c)]
            c.fail(f"computes as {twin.candidate.label!r} does: the same outputs, bit for bit, where the two differ "
                   f"only in the precision level, " + (f"and {twin.candidate.label!r} was dropped: {twin.failed}"
                                                       if twin.failed else "so the run's first steps time one of them"))
        elif c is plain:
            c.record.why = "plain PyTorch: the fp32 reference"
        elif c.candidate.neutral:
            c.record.why = "numerics-neutral: no gate needed"
        elif not has_reference:
            c.fail("no fp32 reference to gate against (plain PyTorch failed)")
        elif not result.passed:
            c.fail(result.why())
        else:
            c.record.why = result.why()


def _level_twins(c: TrialRun, others: List[TrialRun]) -> List[TrialRun]:
    """The candidates of ``others`` on the pick's one copy (`SwitchedRun`) whose gate pass ran and that differ from
    ``c`` only in ``precision.level`` (O1 or O2 bf16): where ``c``'s forward gives one's outputs bit for bit, ``c``
    computes as it does. O2 runs more ops in half than O1 only where autocast leaves an op to its inputs' dtype; where
    every output is the same, every op ran in the same dtype (timm's ResNet-50 and Swin, whose normalization layers
    are kept in fp32 and hand autocast's ops fp32 activations either way), the backward mirrors the forward, and
    timing both would only cost the run the second one's windows. Dropping a twin never changes what trains."""
    if not isinstance(c, SwitchedRun):
        return []
    return [o for o in others if isinstance(o, SwitchedRun) and o.outputs   # a forward that gave floating outputs
            and set(differences(c.candidate.strategy, o.candidate.strategy)) == {"precision.level"}]


def _same_outputs(outputs: List[torch.Tensor], twins: List[TrialRun]) -> Optional[TrialRun]:
    """The one of ``twins`` whose gate pass gave ``outputs``, bit for bit, or None."""
    return next((twin for twin in twins if len(twin.outputs) == len(outputs) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(outputs, twin.outputs))), None)


def _noise_samples(plain: TrialRun, batches) -> List[Tuple[Dict[str, torch.Tensor], int]]:
    """Plain fp32's gradients of samples other than batch 0's, with their counts, for `_sampling_noise`:
    batch 1's, or else the two halves of batch 0 (none for a batch of one sample). Another batch is better:
    under BatchNorm a half batch is normalized over fewer samples, which adds noise of its own (MobileNetV3
    at batch 8: its halves made the noise look 5.6x what two batches show)."""
    size = batch_size_of(batches[0])
    if len(batches) > 1:
        return [(plain.gradients(batches[1]), batch_size_of(batches[1]) or size or 1)]
    if size is None or size < 2:
        return []
    halves = (slice(0, size // 2), slice(size // 2, size))
    return [(plain.gradients(batch_rows(batches[0], half, size)), half.stop - half.start) for half in halves]


def _sampling_noise(reference: Optional[Dict[str, torch.Tensor]], samples, batch: Any) -> Optional[float]:
    """The sampling noise of ``reference`` (plain's gradient of ``batch``), or None without two gradients."""
    if reference is None or not samples:
        return None
    size = batch_size_of(batch) or 1
    (a, size_a), (b, size_b) = samples if len(samples) == 2 else [(reference, size)] + samples
    return gate.sampling_noise(a, b, size_a, size_b, size)


def _timed_rounds(contenders: List[TrialRun], batches, cfg, start: float, status: Optional[StatusLine] = None
                  ) -> None:
    """Rounds of one step per candidate after the gate's, on the one timing engine
    (`aiak.measure.rounds.alternate`: the order rotating every round, each step under the candidate's own
    switches, the slowest rank's seconds, a failure on any rank dropping the candidate on all). Each
    candidate's steps form one series (``warmup_s``, the gate's step first). Timing starts at the round where
    every series has settled (`_settled`: its last `MIN_TIMED_ROUNDS` steps were no faster than the
    best before them), or `WARMUP_MAX_STEPS` steps were taken, or the budget ran out; those last steps
    are the first timed samples, so a candidate that needs no warm-up costs the gate's step and two more.
    Rounds go on until ``cfg.steps`` samples, the budget is spent, or the ranking is clear
    (`_ranking_is_clear`)."""
    runs = [c for c in contenders if not c.failed]
    if not runs:
        return
    for c in runs:
        c.timer = Contender(c.candidate.label, c.timed_step(batches), c.device, c.process_switches)
    rules = _Stopping(cfg.steps, cfg.max_seconds)

    def until(rounds_done: int, elapsed: float) -> bool:
        for c in runs:
            if c.timer.stopped is not None:
                c.fail(c.timer.stopped)
        active = [c for c in runs if not c.failed]
        if status is not None:
            status.update(f"round {rounds_done} of {', '.join(c.candidate.label for c in active)}")
        for c in active:
            c.warmup_s = c.warmup_s[:1] + c.timer.step_seconds
        return not active or rules.done({c.candidate.label: c.warmup_s for c in active}, elapsed)

    with warn.quiet():
        alternate([c.timer for c in runs], warmup=0, rounds=WARMUP_MAX_STEPS + max(cfg.steps, 1), steps_per_round=1,
                  slow_factor=math.inf, catch=True, until=until, started=start)
    for c in runs:   # a failure in the last round ends the rounds before ``until`` sees it
        if c.timer.stopped is not None:
            c.fail(c.timer.stopped)
    timed_from = rules.timed_from
    plain = next((c for c in contenders if c.candidate.label == "plain" and not c.failed), None)
    for c in contenders:
        if c.failed or timed_from is None:
            continue
        c.warmup_s, timed = c.warmup_s[:timed_from], c.warmup_s[timed_from:]
        c.record.samples_ms = [t * 1e3 for t in timed]
    for c in contenders:
        s = c.record.samples_ms
        if s and not c.failed:
            c.record.step_ms = statistics.median(s)
            c.record.step_ms_spread = [min(s), max(s)]
            if plain is not None and len(plain.record.samples_ms) == len(s):
                ratios = [p / t for p, t in zip(plain.record.samples_ms, s)]
                c.record.speedup = statistics.median_low(ratios)  # of an even count, the lower: conservative
                c.record.speedup_spread = [min(ratios), max(ratios)]


class _Stopping:
    """When the trials' timing starts and when their rounds end (steps 5 and 6 of the module docstring), read
    from each candidate's series of step seconds by label (the gate's step first, then one per round: the
    slowest rank's, so every rank decides alike) and the seconds since the trials began."""

    def __init__(self, steps: int, max_seconds: Optional[float]):
        self.steps, self.max_seconds = steps, max_seconds
        self.timed_from: Optional[int] = None   # index, in every series, of the first timed step
        self._elapsed: Optional[float] = None   # at the end of the round before

    def done(self, series: Dict[str, List[float]], elapsed: float) -> bool:
        """Called after every round: whether to stop now (and, the first time timing may start, where)."""
        round_seconds = elapsed - (self._elapsed if self._elapsed is not None else elapsed)
        self._elapsed = elapsed
        budget = self.budget(series)
        out_of_budget = budget is not None and elapsed + round_seconds > budget
        steps = len(next(iter(series.values())))  # the same in every series
        if self.timed_from is None and steps > MIN_TIMED_ROUNDS and (
                out_of_budget or steps >= WARMUP_MAX_STEPS or all(_settled(s) for s in series.values())):
            self.timed_from = steps - MIN_TIMED_ROUNDS
        return self.timed_from is not None and (steps - self.timed_from >= self.steps or out_of_budget
                                                or _ranking_is_clear(series, self.timed_from))

    def budget(self, series: Dict[str, List[float]]) -> Optional[float]:
        """``tune.max_seconds``, or by default `BUDGET_FRACTION` of a `BUDGET_RUN_STEPS`-step run at
        plain PyTorch's speed (its fastest step so far); None without plain."""
        if self.max_seconds is not None:
            return self.max_seconds
        plain = series.get("plain")
        return BUDGET_FRACTION * BUDGET_RUN_STEPS * min(plain) if plain else None


def _ranking_is_clear(series: Dict[str, List[float]], timed_from: int) -> bool:
    """More rounds would not change the decision, so the budget left is not spent: every candidate is faster
    than plain PyTorch in every timed round or slower in every one, by more than `NOISE_FLOOR`, and the
    fastest is faster than each other one in every round."""
    if "plain" not in series:
        return False
    base = series["plain"][timed_from:]
    return ranking_is_clear([[p / t for p, t in zip(base, s[timed_from:])]
                             for label, s in series.items() if label != "plain"])


def _settled(seconds: List[float]) -> bool:
    """Neither of the last `MIN_TIMED_ROUNDS` steps beat the best step before them by more than
    `SETTLE_TOLERANCE`: the one-time costs are spent. (A machine's timing noise only ever adds time, so
    two slow steps that agree with each other do not count.)"""
    return len(seconds) >= 3 and min(seconds[:-2]) <= (1 + SETTLE_TOLERANCE) * min(seconds[-2:])


def _timed_in_run(candidates: List[Candidate], pick: Strategy, optimizer: Any) -> bool:
    """Whether the run's first steps time the candidates (`aiak.tune.guard`) instead of rounds on copies: the rules'
    pick is a candidate of its own, plain is among them, and every one is the pick's model switched between steps
    (`aiak.tune.candidates.switches_between_steps`), where the guard can watch the run. Its steps then train the
    run: a candidate as fast as plain costs nothing there, where rounds on copies cost every candidate's steps; and
    the trials gate every candidate on one copy (`SwitchedRun`)."""
    return (len(candidates) > 1 and candidates[0].label != "plain" and any(c.label == "plain" for c in candidates)
            and not not_watched(pick, optimizer)
            and all(switches_between_steps(c.strategy, candidates[0].strategy) for c in candidates))


def _start_in_run(contenders: List[TrialRun]) -> TrialRun:
    """The pick is applied; every candidate that passed the gate is accepted, to be timed in the run."""
    for c in contenders:
        if not c.failed:
            c.record.accepted = True
            c.record.why += "; timed in the run's first steps (run-time guard)"
    return contenders[0]


def _arm(c: TrialRun) -> Arm:
    """The guard's arm that computes as candidate ``c`` on the pick's model (`aiak.tune.guard.Arm`)."""
    s = c.candidate.strategy
    half = s.precision.level != "O0"
    return Arm(c.candidate.label, dict(c.process_switches), half, level=s.precision.level if half else None,
               channels_last=bool(s.channels_last), fused_ops=frozenset(s.fused_ops) & frozenset(SWITCHED_OPS))


def _preference(contenders: List[TrialRun]) -> List[str]:
    """The guard's preference within noise where it is the only timing: plain compute, the numerics-neutral
    candidates, then the rules' pick (as `_decide` prefers the simpler)."""
    neutral = [c.candidate.label for c in contenders[1:] if c.candidate.neutral and c.candidate.label != "plain"
               and c.record.accepted]
    return [PLAIN_COMPUTE] + neutral + [PICK]


def _simplicity(c: TrialRun) -> int:
    return 0 if c.candidate.label == "plain" else 1 if c.candidate.neutral else 2


def _noise(record: TrialRecord) -> float:
    """Half the range of a candidate's per-round speedups, relative to their median (at least NOISE_FLOOR)."""
    low, high = record.speedup_spread or (0.0, float("inf"))
    return max((high - low) / (2 * record.speedup), NOISE_FLOOR) if record.speedup else float("inf")


def _decide(contenders: List[TrialRun]) -> TrialRun:
    """The fastest accepted candidate, by the median of its per-round speedups over plain PyTorch (each round
    runs every candidate back to back, so a ratio within a round cancels the machine's slow drifts); a
    simpler candidate (plain, then numerics-neutral) whose speedup is within noise of the best is preferred.
    Rank 0 decides and broadcasts (all ranks hold the same max-reduced times anyway)."""
    accepted = [c for c in contenders if not c.failed and c.record.speedup is not None]
    for c in accepted:
        c.record.accepted = True
    index = next(i for i, c in enumerate(contenders) if c.candidate.label == "plain")
    if accepted and on_rank0():
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
    winner = contenders[rank0_index(index)]
    for c in accepted:
        tail = f"{c.record.speedup:.2f}x plain (rounds {c.record.speedup_spread[0]:.2f}-{c.record.speedup_spread[1]:.2f})"
        c.record.why = f"{c.record.why}; {tail}" + ("; chosen" if c is winner else "")
    return winner
