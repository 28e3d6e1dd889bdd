"""The candidate strategies the trials time: the rules' pick and what the rules leave open.

In order of preference (the order breaks ties within noise, and ``tune.candidates`` keeps the first N):

1. the rules' pick (`aiak.strategy.select.select`);
2. its numerics-neutral subset: the pick with every knob that changes numerics set back to plain PyTorch
   (layouts, loader knobs and the fused ops that only change the kernel kept, `aiak.tune.gate.NEUTRAL_KEYS` and
   `aiak.ops.surgery.NEUTRAL_FUSED_OPS`; the training knobs kept as below);
3. plain: plain PyTorch compute (the ``default`` profile's precision, layout, kernels) training what the pick
   trains; always timed, since it is also the fp32 reference of the gate and the speed auto must never fall
   below;
4. one-knob variants of the pick: O2 <-> O1, bf16 <-> fp16, fp8 off, channels_last flipped, fused ops off,
   compile on. fp8 is never added here: only a rule proposes it (``configs/fp8.yaml``: fp8 tensor cores and a
   model whose eligible Linear layers carry most of the work), and then the pick without it is timed beside it.

Candidates differ only in how a step computes: knobs whose effect on the numbers the gate can judge, or that
have none (precision, tf32, channels_last, fused_ops, compile, cudnn_benchmark). Two kinds of knobs are the
pick's in every candidate, plain included, and the rules set them:

* what changes WHAT is trained (`TRAINING_KEYS`: gradient accumulation, the optimizer and its
  hyper-parameters, which samples form a batch, how the inputs are normalized). The gate compares one
  micro-step's gradients, which these leave alone or change by changing the data, and a speed race would
  always prefer doing less (no accumulation, plain SGD); dropping them would silently train another model;
* what a trial step does not exercise (`UNTIMED_KEYS`: the loader, DDP communication, process
  affinity, the tuning settings): the trial feeds the borrowed batches itself and runs without DDP, so
  those knobs could not be told apart.

A variant is only proposed where it can run well: fp16 or bf16 only where the device computes it natively
(``probes.fp16_native`` / ``bf16_native``; emulated half precision runs 7-30x slower on this CPU,
benchmarks/precision_cpu.py), channels_last on only for models with more than one Conv2d (a transformer's patch
embedding alone gains nothing from it: ViT-Tiny's channels_last arm ran 0.91x plain in the guard's windows, as its
pick did; a pick with channels_last on any Conv2d gets the variant without it), and
compile only when the tuning budget can pay for compiling (`COMPILE_MIN_BUDGET_S`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from aiak.ops.surgery import SWITCHED_OPS
from aiak.strategy import knobs
from aiak.strategy.profiles import load_strategy
from aiak.strategy.schema import Strategy
from aiak.strategy.select import leaves
from aiak.tune.gate import is_neutral, neutral_ops
from aiak.strategy.key_paths import put_leaf

# torch.compile spends 10-60 s compiling before its first step on a 2-core CPU (DemoNet: 16.7 s measured with
# torch 2.14), far beyond the default budget (5% of 200 steps); so compile is a candidate only when
# tune.max_seconds allows at least this much.
COMPILE_MIN_BUDGET_S = 60.0
# What a trial step does not exercise, and what changes WHAT is trained (see the module docstring): the knob
# table's rows (aiak.strategy.knobs).
UNTIMED_KEYS = knobs.untimed_keys()
TRAINING_KEYS = knobs.training_keys()


@dataclass
class Candidate:
    label: str
    strategy: Strategy
    changes: Dict[str, Any]   # key path -> value, where it differs from plain PyTorch

    @property
    def neutral(self) -> bool:
        return is_neutral(self.changes)


def differences(strategy: Strategy, base: Strategy) -> Dict[str, Any]:
    """Key paths where ``strategy`` differs from ``base``, with ``strategy``'s values."""
    a, b = dict(leaves(strategy.to_dict())), dict(leaves(base.to_dict()))
    return {k: v for k, v in a.items() if b.get(k) != v}


def with_picks_knobs(data: Dict[str, Any], pick: Strategy) -> Dict[str, Any]:
    """``data`` (a strategy dict) with the pick's `TRAINING_KEYS` and `UNTIMED_KEYS`, which no
    trial decides: whole sections where a key names one (``optimizer`` with its hyper-parameters)."""
    picked = pick.to_dict()
    for key in UNTIMED_KEYS + TRAINING_KEYS:
        section, _, leaf = key.partition(".")
        if leaf:
            data.setdefault(section, {})[leaf] = copy.deepcopy(picked[section][leaf])
        else:
            data[key] = copy.deepcopy(picked[key])
    return data


def _variant(pick: Strategy, label: str, changes: Dict[str, Any]) -> Strategy:
    data = pick.to_dict()
    for path, value in changes.items():
        put_leaf(data, path, value)
    data["name"] = f"{pick.name}:{label}"
    return Strategy.from_dict(data, source=f"<candidate {label}>")


def candidate_strategies(pick: Strategy, probes: Any, *, limit: int, max_seconds: Optional[float]) -> List[Candidate]:
    """Up to ``limit`` distinct candidates (plain PyTorch always among them), in order of preference."""
    plain_data = with_picks_knobs(load_strategy("default").to_dict(), pick)
    plain_data["name"] = "plain"
    plain = Strategy.from_dict(plain_data, source="<candidate plain>")
    changed = differences(pick, plain)
    neutral_changes = {k: v for k, v in changed.items() if is_neutral({k: v})}
    if neutral_ops(changed.get("fused_ops", [])):   # the neutral ops of a list that also holds others
        neutral_changes["fused_ops"] = neutral_ops(changed["fused_ops"])
    proposals = [(pick.name, pick), ("neutral", _variant(plain, "neutral", neutral_changes)), ("plain", plain)]

    p = pick.precision
    native = {"bf16": bool(getattr(probes, "bf16_native", False)), "fp16": bool(getattr(probes, "fp16_native", False))}
    if p.level == "O1":
        proposals.append(("O2", _variant(pick, "O2", {"precision.level": "O2"})))
    if p.level == "O2":
        proposals.append(("O1", _variant(pick, "O1", {"precision.level": "O1"})))
    if p.level != "O0":
        other = "fp16" if p.dtype == "bf16" else "bf16"
        if native[other]:
            proposals.append((other, _variant(pick, other, {"precision.dtype": other})))
    if p.fp8 != "off":  # fp8 is timed against the same pick in bf16
        proposals.append(("fp8=off", _variant(pick, "fp8=off", {"precision.fp8": "off"})))
    modules = getattr(probes, "modules", {}) or {}
    convs = modules.get("conv2d", 0)
    if convs > 1 or (convs and pick.channels_last):   # on: more than a transformer's patch embedding; off: any
        flag = not pick.channels_last
        proposals.append((f"channels_last={str(flag).lower()}", _variant(pick, "channels_last", {"channels_last": flag})))
    if pick.fused_ops:
        proposals.append(("no_fused_ops", _variant(pick, "no_fused_ops", {"fused_ops": []})))
    if not pick.compile and max_seconds is not None and max_seconds >= COMPILE_MIN_BUDGET_S:
        proposals.append(("compile", _variant(pick, "compile", {"compile": True})))

    out: List[Candidate] = []
    seen = []
    for label, strategy in proposals:
        changes = differences(strategy, plain)
        if changes in seen or (not changes and label != "plain"):  # what equals plain PyTorch is called plain
            continue
        seen.append(changes)
        out.append(Candidate(label, strategy, changes))
    keep = out[:max(limit, 1)]
    if not any(c.label == "plain" for c in keep):
        keep = keep[:max(limit, 2) - 1] + [c for c in out if c.label == "plain"]
    return keep


# What the run-time guard switches exactly between two steps of one applied model (`aiak.tune.guard.Arm`), besides
# half compute off (precision O0) and its level: the process switches each arm writes, and the layout.
SWITCHED_KEYS = ("tf32", "cudnn_benchmark", "channels_last")


def switches_between_steps(candidate: Strategy, pick: Strategy) -> bool:
    """Whether the model ``pick`` applies can compute as ``candidate`` by switching between two steps, with nothing
    rebuilt: ``candidate`` differs from ``pick`` only in half compute off (O0), the other level of bf16 half compute
    (`aiak.amp.half_compute.HalfCompute.switch_level`; not with ``precision.keep_fp32``, whose O2 hooks O1 lacks),
    the channels_last layout (`aiak.runtime.switches.ChannelsLast`), the pick's fused window attention or 1x1
    convolutions as matrix multiplies off (`aiak.ops.surgery.FusedOpsSwitch`), and `SWITCHED_KEYS`. fp8, fp16 (its
    loss scaling), the fused language-model head and compile are built, not switched."""
    if pick.precision.fp8 != "off" or pick.compile:
        return False
    half = candidate.precision.level != "O0"
    for key, value in differences(candidate, pick).items():
        if key in SWITCHED_KEYS or (key.startswith("precision.") and not half):
            continue
        if key == "fused_ops" and set(pick.fused_ops) - set(candidate.fused_ops) <= set(SWITCHED_OPS) \
                and set(candidate.fused_ops) <= set(pick.fused_ops):
            continue
        if key == "precision.level" and pick.precision.dtype == "bf16" and not pick.precision.keep_fp32:
            continue
        return False
    return not half or candidate.precision.dtype == "bf16"
