"""``auto`` against plain PyTorch and against the best strategy found by sweeping the whole space.

    python benchmarks/auto.py [--models demo,vit,...] [--rounds 15] [--no-compile] [--json FILE]
    python benchmarks/auto.py --quick          # smoke run: demo and mlp, small, no compile, a few rounds

Eight CPU-sized models of different families, each trained with the optimizer its family uses
(:func:`aiak.cli.model_spec.default_optimizer`: AdamW for transformers, SGD otherwise); random weights, nothing
downloaded:

* ``demo``: :class:`aiak.cli.demo.DemoNet` (ResNet-style CNN with BatchNorm), 3x32x32, batch 64, SGD;
* ``vit``: timm ``vit_tiny_patch16_224`` at 64 px (a transformer encoder over 16 patches + class token),
  batch 32, AdamW;
* ``swin``: timm ``swin_tiny_patch4_window7_224`` made small: 64 px, window 4, embed_dim 48, depths 2,2,2,2,
  batch 32, AdamW;
* ``mlp``: Flatten, 3072-1024-1024-10 with GELU, batch 128, SGD;
* ``mobilenet``: timm ``mobilenetv3_small_050`` at 64 px (depthwise-separable convolutions, squeeze-excite,
  hard-swish, BatchNorm; Howard et al. 2019), 0.6M parameters, batch 64, SGD;
* ``nfnet``: timm ``nf_resnet26`` at 64 px, a ResNet without any normalization layer (scaled weight-standardized
  convolutions; Brock et al. 2021, "Characterizing signal propagation to close the performance gap in
  unnormalized ResNets"), 14M parameters, batch 16, SGD;
* ``resnet50``: timm ``resnet50`` at 32 px (bottleneck blocks, BatchNorm), 23.5M parameters, batch 16, SGD;
* ``vit_small``: timm ``vit_small_patch16_224`` at 64 px with 6 of its 12 blocks (width 384, 6 heads, 16
  patches + class token: twice ``vit``'s width, half its depth), 11.0M parameters, batch 16, AdamW.

Contenders, all from the same seed (same initial weights, same batches):

* ``plain``: the setup as built, fp32 eager, no aiak;
* the oracle: every strategy of the space, each a strategy dict through ``aiak.optimize`` with tune off:
  precision {O0, O1 bf16, O2 bf16} (O1/O2 fp16 too where the device computes fp16 natively, never on this
  CPU) x channels_last {off, on} (models with a Conv2d) x compile {off, on} x fused_ops
  {[], [window_attention]} (models whose window attention aiak can fuse) x {[], [pointwise_conv]} (models with
  1x1 convolutions it computes as matrix multiplies: `` +1x1mm``). Every oracle strategy also has
  ``loader.prefetch: 2``, ``optimizer.fused: true`` and ``malloc_retain: true``, which auto's base profile sets,
  so the oracle covers auto's own pick;
* ``auto``: ``aiak.optimize(model, optimizer, loader)`` with a fresh tuning cache, so its trials run and are
  paid in full.

Timing: every contender is built first, warmed up (``--warmup`` steps; a compiled one compiles here), then
all are timed round-robin by :func:`optimizers.time_round_robin` (one step each per round, order shuffled
every round) for ``--rounds`` rounds. A step is what a user's loop does: next batch from the contender's
loader, forward, cross-entropy, backward, ``optimizer.step()``, ``zero_grad()``. The tables give the median
step with its p10-p90 spread, and the speed ratio to plain: plain's step over the contender's, paired
within each round, median over rounds with its p10-p90. auto's *effective* step adds the wall time of its
``optimize()`` call (trials included; the decision record's ``tuning_seconds`` is printed beside it) and its
first steps' excess over steady ones while its run-time guard alternates the pick with plain compute (auto's
warm-up goes on until the guard decided), spread over a 200-step run: ``step + one_time / 200``. The oracle's
compile time is not counted (its steady state only), which favours the oracle. All share one process, so
once a contender applied ``malloc_retain`` (glibc malloc's thresholds fixed: ``aiak.runtime.malloc``), plain steps
with it too: a process cannot turn glibc's own thresholds back on. Its gain, which every ratio here leaves out, is
``benchmarks/separate_processes.py``'s, timed in processes of their own.

Loss: plain, auto and the oracle's best are trained again from the same seed for ``--loss-steps`` steps
(60) on the same batches; the final loss is the mean of the last 10 steps. Each model's synthetic images carry
enough noise that plain fp32 is still at a loss of 1.0-1.4 after 60 steps (measured: demo 1.11, vit 1.42, swin 1.14,
mlp 1.01, mobilenet 1.30, nfnet 1.23, resnet50 1.03, vit_small 1.31), so a numerics difference would show. auto's
must be within ``max(5%, 0.02)`` of plain fp32's, or within plain's own spread where that is wider: the largest
difference that ``--loss-perturbations`` (8) plain runs make from weights moved by a relative 1e-6, rounding-sized,
before their first step (MobileNetV3's loss after 60 steps moved by -0.078 to +0.090 so, six seeds, where 5% of it
is 0.069: its early steps amplify any difference, the few steps auto's guard computes in bf16 among them).
ResNet-50's train-mode BatchNorm over 1x1 maps of 16 images amplifies more: seeds 1-8 moved its loss by +0.003 to
+0.731, where seeds 0-2 moved it by +0.025 to +0.186: three runs understate the spread.

Goals per model (each printed ok / NOT ok): auto effective >= 0.95x the oracle's best; auto effective
>= 0.98x plain; final loss within tolerance; on ``demo``, auto effective >= 1.8x plain. A ratio whose
spread straddles the goal is flagged "(within noise)".
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from optimizers import time_round_robin  # noqa: E402

import aiak  # noqa: E402
from aiak.cli import model_spec  # noqa: E402
from aiak.util.warn import quiet  # noqa: E402  (silences aiak without spending its warn-once keys)
from aiak.tune.trials import BUDGET_FRACTION, BUDGET_RUN_STEPS  # noqa: E402

RUN_STEPS = 200            # the run length auto's tuning cost is spread over
LOSS_TAIL = 10             # final loss = mean of the last 10 steps
LOSS_RTOL, LOSS_ATOL = 0.05, 0.02
PERTURBATION = 1e-6        # plain's weights moved by this much of their mean magnitude: rounding-sized
GOAL_VS_ORACLE, GOAL_VS_PLAIN, GOAL_DEMO = 0.95, 0.98, 1.8


# ------------------------------------------------------------------------------------------ models

def _timm(name: str, **kwargs) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, drop_rate=0.0, drop_path_rate=0.0, **kwargs)


def _demo() -> nn.Module:
    from aiak.cli.demo import DemoNet

    return DemoNet()


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 10))


@dataclass(frozen=True)
class ModelCase:
    name: str
    spec: str                                   # what the description calls it
    factory: Callable[[], nn.Module]
    input_shape: tuple
    batch_size: int
    quick_batch_size: int
    noise: float                                # synthetic images' noise: plain fp32 ends 60 steps at loss ~1-1.4


CASES = {
    "demo": ModelCase("demo", "demo", _demo, (3, 32, 32), 64, 32, noise=0.8),
    "vit": ModelCase("vit", "timm:vit_tiny_patch16_224@64px", lambda: _timm("vit_tiny_patch16_224", img_size=64),
                     (3, 64, 64), 32, 8, noise=9.0),
    "swin": ModelCase("swin", "timm:swin_tiny_patch4_window7_224@64px,window4,dim48,depths2222",
                      lambda: _timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=48,
                                    depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16)),
                      (3, 64, 64), 32, 8, noise=20.0),
    "mlp": ModelCase("mlp", "mlp:3072-1024-1024-10", _mlp, (3, 32, 32), 128, 32, noise=20.0),
    "mobilenet": ModelCase("mobilenet", "timm:mobilenetv3_small_050@64px",
                           lambda: _timm("mobilenetv3_small_050"), (3, 64, 64), 64, 16, noise=2.0),
    # no normalization layer: the input's scale reaches every layer, and noise 20 made SGD diverge (NaN loss)
    "nfnet": ModelCase("nfnet", "timm:nf_resnet26@64px", lambda: _timm("nf_resnet26"), (3, 64, 64), 16, 4,
                       noise=2.0),
    "resnet50": ModelCase("resnet50", "timm:resnet50@32px", lambda: _timm("resnet50"), (3, 32, 32), 16, 4,
                          noise=3.0),
    "vit_small": ModelCase("vit_small", "timm:vit_small_patch16_224@64px,depth6",
                           lambda: _timm("vit_small_patch16_224", img_size=64, depth=6), (3, 64, 64), 16, 4,
                           noise=10.0),
}


_MATERIALISED: Dict[tuple, TensorDataset] = {}


def make_setup(case: ModelCase, batch_size: int, samples: int, seed: int = 0) -> model_spec.ModelSetup:
    """A fresh model (weights from ``seed``), its optimizer, and a loader over the case's synthetic samples.

    The images are :class:`aiak.cli.model_spec.SyntheticImages` with the case's noise (the default 0.8 lets
    ViT, Swin and the MLP reach a loss near 0 within 60 steps, where a loss comparison says nothing). They
    are materialised once per case and shared by every contender's loader (each with its own seeded
    shuffle, so all see the same batches in the same order): a batch then costs a fraction of a millisecond
    to load, so a prefetching contender's background thread takes next to nothing from the steps of the
    contenders timed while it refills.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = case.factory()
    setup = model_spec.from_model(model, spec=case.spec, input_shape=case.input_shape, batch_size=batch_size,
                                  samples=batch_size, seed=seed)
    key = (case.name, batch_size, samples, seed)
    if key not in _MATERIALISED:
        data = model_spec.SyntheticImages(samples, case.input_shape, num_classes=10, seed=seed, noise=case.noise)
        images, labels = zip(*(data[i] for i in range(len(data))))
        _MATERIALISED[key] = TensorDataset(torch.stack(images), torch.stack(labels))
    setup.loader = DataLoader(_MATERIALISED[key], batch_size=batch_size, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(seed))
    return setup


# ------------------------------------------------------------------------------------------ the space

def oracle_space(setup: model_spec.ModelSetup, *, compile_too: bool) -> Dict[str, dict]:
    """label -> strategy dict: the exhaustive sweep of the module docstring."""
    from aiak import ops
    from aiak.strategy.probes import probe

    probes = probe(setup.model)
    precisions = [("fp32", {"level": "O0"}), ("O1 bf16", {"level": "O1", "dtype": "bf16"}),
                  ("O2 bf16", {"level": "O2", "dtype": "bf16"})]
    if probes.fp16_native:
        precisions += [("O1 fp16", {"level": "O1", "dtype": "fp16"}), ("O2 fp16", {"level": "O2", "dtype": "fp16"})]
    has_conv = any(isinstance(m, nn.Conv2d) for m in setup.model.modules())
    fusable = ops.replace_window_attention(copy.deepcopy(setup.model)) > 0
    pointwise = probes.modules.get("pointwise_conv", 0) > 0
    space = {}
    for (plabel, precision), cl, comp, fused, mm in itertools.product(
            precisions, [False, True] if has_conv else [False], [False, True] if compile_too else [False],
            [False, True] if fusable else [False], [False, True] if pointwise else [False]):
        fused_ops = ["window_attention"] * fused + ["pointwise_conv"] * mm
        label = plabel + (" +cl" if cl else "") + (" +compile" if comp else "") + _ops_label(fused_ops)
        space[label] = {"name": f"oracle {label}", "precision": precision, "channels_last": cl, "compile": comp,
                        "fused_ops": fused_ops, "loader": {"prefetch": 2},
                        "optimizer": {"fused": True}, "malloc_retain": True, "tune": False}
    return space


def _ops_label(fused_ops) -> str:
    """The oracle's label of ``fused_ops``: `` +fused`` (window attention), `` +1x1mm`` (1x1 convolutions as matrix
    multiplies)."""
    ops = set(fused_ops or ())
    return " +fused" * ("window_attention" in ops) + " +1x1mm" * ("pointwise_conv" in ops)


# ------------------------------------------------------------------------------------------ contenders

@dataclass
class Contender:
    label: str
    model: Any
    optimizer: Any
    loader: Any
    note: str = ""
    optimize_s: float = 0.0
    tuning_s: float = 0.0
    warmup_s: float = 0.0                        # its first steps (compiling, for a compiled one)
    warmup_steps: int = 0                        # how many: --warmup, or more for auto until its guard decided
    decision: Any = None                         # auto only: its decision record (the guard writes into it)
    trials: Optional[List[dict]] = None          # auto only: its decision record's trials
    pick: str = ""                               # auto only: its pick in the oracle's labels
    _it: Any = None

    def step(self) -> float:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            batch = next(self._it)
        loss = model_spec.compute_loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


def _changed_knobs(decision) -> str:
    """auto's pick as the knobs that differ from plain PyTorch, e.g. ``precision.level=O1, channels_last=true``."""
    from aiak.strategy.profiles import load_strategy
    from aiak.tune.candidates import differences

    applied = aiak.Strategy.from_dict(decision.to_dict()["strategy"], source="<decision>")
    changes = differences(applied, load_strategy("default"))
    keep = {k: v for k, v in changes.items() if not k.startswith(("tune", "name"))}
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(keep.items())) or "plain PyTorch"


def _pick_label(decision) -> str:
    """auto's pick named as the oracle's strategies are (``O1 bf16 +cl``), so the two can be compared."""
    applied = decision.to_dict()["strategy"]
    precision = applied["precision"]
    label = "fp32" if precision["level"] == "O0" else f"{precision['level']} {precision['dtype']}"
    return (label + (" +cl" if applied["channels_last"] else "") + (" +compile" if applied["compile"] else "")
            + _ops_label(applied["fused_ops"]))


def _arm_label(changes: Dict[str, Any]) -> str:
    """A trial candidate's changes from plain PyTorch (its decision row's ``strategy``) in the oracle's labels."""
    level = changes.get("precision.level", "O0")
    dtype = changes.get("precision.dtype", aiak.Strategy().precision.dtype)
    label = "fp32" if level == "O0" else f"{level} {dtype}"
    return (label + (" +cl" if changes.get("channels_last") else "") + (" +compile" if changes.get("compile") else "")
            + _ops_label(changes.get("fused_ops")))


def guard_choice(c: Contender) -> None:
    """Where auto's run-time guard decided (after the warm-up), its chosen arm is what auto computes with from then
    on: the pick in the oracle's labels follows it."""
    guard = c.decision.guard if c.decision is not None else {}
    if "speedups" not in guard:
        return
    c.note += f"; the guard chose {guard['chosen']!r} after {guard['steps']} steps"
    rows = {t["label"]: t for t in c.trials or []}
    chosen = guard["chosen"]
    row = (rows.get("plain") if chosen == "plain compute" else (c.trials or [None])[0] if chosen.startswith("pick")
           else rows.get(chosen))
    if row is not None:
        c.pick = _arm_label(row["strategy"])


def build_auto(case: ModelCase, batch_size: int, samples: int) -> Contender:
    setup = make_setup(case, batch_size, samples)
    with quiet():
        t0 = time.perf_counter()
        model, optimizer, loader = aiak.optimize(setup.model, setup.optimizer, setup.loader)
        wall = time.perf_counter() - t0
    decision = aiak.last_decision()
    d = decision.to_dict()
    c = Contender("auto", model, optimizer, loader, optimize_s=wall, tuning_s=float(d["tuning_seconds"]))
    c.note = f"picked {_changed_knobs(decision)}; {len(d['trials'])} trials" + (" (cache hit)" * d["cache_hit"])
    c.trials, c.pick, c.decision = d["trials"], _pick_label(decision), decision
    return c


def build_contenders(case: ModelCase, batch_size: int, samples: int, compile_too: bool) -> List[Contender]:
    setup = make_setup(case, batch_size, samples)
    out = [Contender("plain", setup.model, setup.optimizer, setup.loader)]
    for label, strategy in oracle_space(setup, compile_too=compile_too).items():
        s = make_setup(case, batch_size, samples)
        with quiet():
            model, optimizer, loader = aiak.optimize(s.model, s.optimizer, s.loader, strategy=strategy)
        out.append(Contender(label, model, optimizer, loader))
    out.append(build_auto(case, batch_size, samples))
    return out


GUARD_MAX_STEPS = 60   # auto's warm-up goes on until its run-time guard decided, at most this many steps


def _guard_watching(c: Contender) -> bool:
    guard = c.decision.guard if c.decision is not None else {}
    return bool(guard) and "speedups" not in guard and guard.get("why", "").startswith("watching")


def warm_up(contenders: List[Contender], steps: int) -> None:
    """``steps`` steps each (compiled contenders compile here); a compile that fell back to eager is noted.
    auto goes on until its run-time guard (`aiak.tune.guard`) has decided: its windows of plain compute are a
    one-time cost of the run's first steps, counted as the warm-up's excess over steady steps, like compiling."""
    for c in contenders:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            c.warmup_steps = 0
            while c.warmup_steps < steps or (_guard_watching(c) and c.warmup_steps < GUARD_MAX_STEPS):
                c.step()
                c.warmup_steps += 1
            c.warmup_s = time.perf_counter() - t0
        fallback = [w for w in caught if "eager" in str(w.message) and "compile" in str(w.message)]
        if fallback:
            c.note = (c.note + "; " if c.note else "") + "compile fell back to eager"


# ------------------------------------------------------------------------------------------ measuring

def _quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class Row:
    label: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    vs_plain: float                 # median over rounds of plain's step / this step, paired within each round
    vs_plain_p10: float
    vs_plain_p90: float
    note: str = ""
    effective_ms: Optional[float] = None


def paired_ratios(numerator: List[float], denominator: List[float]) -> List[float]:
    """Round by round (both were timed in the same round, so drift hits both alike)."""
    return [a / b for a, b in zip(numerator, denominator)]


def _ratio_stats(ratios: List[float]) -> tuple:
    return statistics.median(ratios), _quantile(ratios, 0.1), _quantile(ratios, 0.9)


def final_loss(case: ModelCase, batch_size: int, samples: int, steps: int, strategy: Any,
               perturbed: Optional[int] = None) -> float:
    """Mean loss of the last :data:`LOSS_TAIL` of ``steps`` steps, from the benchmark's seed; with ``perturbed`` (a
    seed), plain PyTorch from weights each moved by a normal draw of :data:`PERTURBATION` times its tensor's mean
    magnitude."""
    setup = make_setup(case, batch_size, samples)
    model, optimizer, loader = setup.model, setup.optimizer, setup.loader
    if perturbed is not None:
        draw = torch.Generator().manual_seed(perturbed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=draw, dtype=p.dtype) * (PERTURBATION * float(p.abs().mean())))
    if strategy is not None:
        with quiet():
            model, optimizer, loader = aiak.optimize(model, optimizer, loader, **({} if strategy == "auto" else
                                                                                 {"strategy": strategy}))
    c = Contender("loss", model, optimizer, loader)
    losses = [c.step() for _ in range(steps)]
    return statistics.mean(losses[-LOSS_TAIL:])


def _goal(name: str, ratios: List[float], goal: float) -> dict:
    value, low, high = _ratio_stats(ratios)
    ok = value >= goal
    noise = "" if (low >= goal) == (high >= goal) else " (within noise)"
    print(f"    {name:<44} {value:6.2f}x  (p10-p90 {low:.2f}-{high:.2f})  goal >= {goal}  "
          f"{'ok' if ok else 'NOT ok'}{noise}")
    return {"goal": name, "value": value, "low": low, "high": high, "target": goal, "ok": ok}


def run_model(case: ModelCase, args) -> dict:
    batch = case.quick_batch_size if args.quick else case.batch_size
    samples = batch * 32
    print(f"\n== {case.name}: {case.spec}, batch {batch}")
    t0 = time.perf_counter()
    contenders = build_contenders(case, batch, samples, compile_too=not args.no_compile)
    print(f"   built {len(contenders)} contenders in {time.perf_counter() - t0:.1f} s; warming up ...")
    t0 = time.perf_counter()
    warm_up(contenders, args.warmup)
    print(f"   warm-up {time.perf_counter() - t0:.1f} s; timing {args.rounds} rounds ...")
    times = time_round_robin({c.label: c.step for c in contenders}, repeats=args.rounds, warmup=0)
    auto_c = next(c for c in contenders if c.label == "auto")
    guard_choice(auto_c)
    guard_excess = max(0.0, auto_c.warmup_s - auto_c.warmup_steps * statistics.median(times["auto"]))
    # Every contender's effective step over a 200-step run: its steady step plus its one-time costs spread
    # over the run: the warm-up steps' excess over steady steps (compiling, for a compiled one) and, for
    # auto, its optimize() call (the trials). The oracle pays for its compiles as auto pays for its trials.
    for c in contenders:
        steady = statistics.median(times[c.label])
        one_time = c.optimize_s + max(0.0, c.warmup_s - c.warmup_steps * steady)
        effective = [t + one_time / RUN_STEPS for t in times[c.label]]
        times["auto effective" if c.label == "auto" else c.label] = effective
    rows = []
    for label, t in times.items():
        note = next((c.note for c in contenders if c.label == label), "")
        rows.append(Row(label, statistics.median(t) * 1e3, _quantile(t, 0.1) * 1e3, _quantile(t, 0.9) * 1e3,
                        *_ratio_stats(paired_ratios(times["plain"], t)), note))
    oracle = [r for r in rows if r.label not in ("plain", "auto", "auto effective")]
    best = min(oracle, key=lambda r: r.median_ms)
    # auto's trials leave compile out under the default budget (aiak.tune.candidates.COMPILE_MIN_BUDGET_S),
    # so the best eager strategy is printed too: it tells a missed compile from a missed precision or layout
    eager_best = min((r for r in oracle if "+compile" not in r.label), key=lambda r: r.median_ms)
    print(f"\n   {'contender':<30} {'median ms':>10} {'p10-p90 ms':>17} {'vs plain (p10-p90)':>22}  note")
    for r in sorted(rows, key=lambda r: r.median_ms):
        mark = "  <- oracle best" if r is best else "  <- best without compile" if r is eager_best else ""
        print(f"   {r.label:<30} {r.median_ms:10.2f} {r.p10_ms:8.2f}-{r.p90_ms:<8.2f} {r.vs_plain:7.2f}x "
              f"({r.vs_plain_p10:.2f}-{r.vs_plain_p90:.2f})  {r.note}{mark}")
    print(f"   every row but 'auto' is effective over {RUN_STEPS} steps: steady step + one-time costs / {RUN_STEPS} "
          f"(warm-up excess: compiling; auto's guard windows); auto effective adds its optimize() "
          f"{auto_c.optimize_s:.2f} s "
          f"(decision tuning_seconds {auto_c.tuning_s:.2f} s)")
    # the trials' default budget (aiak.tune.trials): 5% of a 200-step run at plain PyTorch's step, here plain's median
    budget_s = BUDGET_FRACTION * BUDGET_RUN_STEPS * statistics.median(times["plain"])
    print(f"   auto's trials took {auto_c.tuning_s:.2f} s against a budget of about {budget_s:.2f} s "
          f"({BUDGET_FRACTION:.0%} of {BUDGET_RUN_STEPS} plain steps)"
          + ("" if auto_c.tuning_s <= budget_s else f": over by {auto_c.tuning_s / budget_s - 1:.0%}")
          + f"; its first {auto_c.warmup_steps} steps (the guard's windows) took {guard_excess:.2f} s more than "
            f"steady ones")
    print("   auto's own trials: " + "; ".join(
        f"{t['label']} {t['step_ms']:.1f} ms" if t["step_ms"] else f"{t['label']} -" for t in auto_c.trials or [])
        + " -> " + next((t["label"] for t in auto_c.trials or [] if "chosen" in t["why"]), "none chosen"))
    del contenders

    print(f"   final loss after {args.loss_steps} steps (mean of the last {LOSS_TAIL}) ...")
    best_strategy = next(s for label, s in oracle_space(make_setup(case, batch, samples),
                                                        compile_too=not args.no_compile).items() if label == best.label)
    losses = {"plain": final_loss(case, batch, samples, args.loss_steps, None),
              "auto": final_loss(case, batch, samples, args.loss_steps, "auto"),
              f"oracle best ({best.label})": final_loss(case, batch, samples, args.loss_steps, best_strategy)}
    chaos = [final_loss(case, batch, samples, args.loss_steps, None, perturbed=seed) - losses["plain"]
             for seed in range(args.loss_perturbations)]
    band = max(map(abs, chaos), default=0.0)
    tol = max(LOSS_RTOL * losses["plain"], LOSS_ATOL, band)
    for k, v in losses.items():
        print(f"    {k:<44} {v:.4f}" + ("" if k == "plain" else f"  (diff {v - losses['plain']:+.4f})"))
    if chaos:
        print(f"    {f'plain, weights moved by {PERTURBATION:g} (x{len(chaos)})':<44} diffs "
              + ", ".join(f"{d:+.4f}" for d in chaos))

    print("   goals (speed ratios: median over rounds, p10-p90 across rounds):")
    effective = times["auto effective"]
    goals = [_goal("auto effective / oracle best", paired_ratios(times[best.label], effective), GOAL_VS_ORACLE),
             _goal("auto effective / plain", paired_ratios(times["plain"], effective), GOAL_VS_PLAIN)]
    eager = _ratio_stats(paired_ratios(times[eager_best.label], effective))
    print(f"    {'(info) auto effective / best without compile':<44} {eager[0]:6.2f}x  (p10-p90 {eager[1]:.2f}-"
          f"{eager[2]:.2f})  {eager_best.label}")
    loss_ok = abs(losses["auto"] - losses["plain"]) <= tol
    print(f"    {'final loss auto vs plain fp32':<44} {losses['auto'] - losses['plain']:+.4f}   "
          f"tolerance +-{tol:.4f} (max({LOSS_RTOL:.0%} of plain, {LOSS_ATOL}, plain's own spread))  "
          f"{'ok' if loss_ok else 'NOT ok'}")
    goals.append({"goal": "final loss", "value": losses["auto"] - losses["plain"], "target": tol, "ok": loss_ok})
    if case.name == "demo":
        goals.append(_goal("demo: auto effective / plain", paired_ratios(times["plain"], effective), GOAL_DEMO))
    return {"model": case.name, "spec": case.spec, "batch_size": batch, "rows": [r.__dict__ for r in rows],
            "oracle_best": best.label, "eager_best": eager_best.label, "auto_vs_eager_best": eager[0],
            "auto_note": auto_c.note, "auto_pick": auto_c.pick, "auto_trials": auto_c.trials,
            "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}, "auto_optimize_s": auto_c.optimize_s,
            "auto_tuning_s": auto_c.tuning_s, "auto_budget_s": budget_s, "auto_guard_excess_s": guard_excess,
            "auto_guard": auto_c.decision.guard if auto_c.decision is not None else {},
            "losses": losses, "loss_tolerance": tol, "plain_perturbed_diffs": chaos,
            "goals": goals}


def print_summary(results: List[dict]) -> None:
    """One line per model: the figures the README quotes, and the goals it missed."""
    print(f"\nsummary (every step effective over {RUN_STEPS} steps; ratios: median over rounds, p10-p90):")
    print(f"  {'model (batch)':<16} {'plain ms':>8}  {'oracle best':<20} {'ms':>7}  {'auto pick':<20} {'ms':>7}  "
          f"{'vs plain':<18} {'vs oracle best':<18} {'w/o compile':>11} {'trials s / budget':>17}  "
          f"{'loss diff (tol)':<16} missed")
    for r in results:
        rows = {row["label"]: row for row in r["rows"]}
        g = {x["goal"]: x for x in r["goals"]}
        vs_plain, vs_oracle = g["auto effective / plain"], g["auto effective / oracle best"]
        missed = ", ".join(x["goal"] for x in r["goals"] if not x["ok"]) or "-"
        print(f"  {r['model'] + ' (' + str(r['batch_size']) + ')':<16} {rows['plain']['median_ms']:8.2f}  "
              f"{r['oracle_best']:<20} {rows[r['oracle_best']]['median_ms']:7.2f}  {r['auto_pick']:<20} "
              f"{rows['auto effective']['median_ms']:7.2f}  "
              f"{vs_plain['value']:.2f}x ({vs_plain['low']:.2f}-{vs_plain['high']:.2f})  "
              f"{vs_oracle['value']:.2f}x ({vs_oracle['low']:.2f}-{vs_oracle['high']:.2f})  "
              f"{r['auto_vs_eager_best']:10.2f}x "
              f"{r['auto_tuning_s']:7.2f} / {r['auto_budget_s']:<7.2f}  "
              f"{g['final loss']['value']:+.4f} ({r['loss_tolerance']:.3f})  {missed}")


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated, from {', '.join(CASES)} (default: all; "
                                                   f"--quick: demo,mlp)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 3; --quick 1)")
    ap.add_argument("--loss-steps", type=int, default=None,
                    help="steps of the loss comparison (default 60; --quick 12)")
    ap.add_argument("--loss-perturbations", type=int, default=None,
                    help="plain runs from rounding-sized moves of its weights, whose spread widens the loss "
                         "tolerance (default 8; --quick 0)")
    ap.add_argument("--no-compile", action="store_true", help="leave compile out of the oracle's space")
    ap.add_argument("--quick", action="store_true", help="smoke run: small batches, few rounds, no compile")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results there")
    args = ap.parse_args(argv)
    args.no_compile = args.no_compile or args.quick
    args.rounds = args.rounds or (3 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.loss_steps = args.loss_steps or (12 if args.quick else 60)
    if args.loss_perturbations is None:
        args.loss_perturbations = 0 if args.quick else 8
    if args.loss_steps <= LOSS_TAIL:
        ap.error(f"--loss-steps must be more than {LOSS_TAIL}")
    names = (args.models or ("demo,mlp" if args.quick else ",".join(CASES))).split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")

    # A fresh tuning cache: auto's trials run (and are paid for) in this run, never answered from an earlier one.
    cache_dir = tempfile.mkdtemp(prefix="aiak-auto-bench-")
    os.environ["AIAK_TUNE_CACHE"] = os.path.join(cache_dir, "tune-cache.json")
    # a fresh inductor cache too: a compiled contender pays its first compile, as a user's first run does
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    from aiak.strategy.probes import probe

    p = probe(None)
    print(f"aiak auto benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, {p.cpu_model}, "
          f"bf16 native {p.bf16_native}, fp16 native {p.fp16_native}; load average {load:.1f}; "
          f"{args.rounds} rounds, warm-up {args.warmup}, compile in the oracle: {not args.no_compile}")
    results = []
    for n in names:
        results.append(run_model(CASES[n], args))
        if args.json:  # after every model: a long run that is stopped keeps what it measured
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)
    print_summary(results)
    return results


if __name__ == "__main__":
    main()
