"""The candidate strategies the trials time: the rules' pick and what the rules leave open.

In order of preference (the order breaks ties within noise, and ``tune.candidates`` keeps the first N):

1. the rules' pick (:func:`aiak.strategy.select.select`);
2. its numerics-neutral subset: the pick with every knob that changes numerics set back to plain PyTorch
   (layouts and loader knobs kept; :data:`aiak.tune.gate.NEUTRAL_KEYS`);
3. plain PyTorch (the ``default`` profile); always timed, since it is also the fp32 reference of the gate
   and the speed auto must never fall below;
4. one-knob variants of the pick: O2 <-> O1, bf16 <-> fp16, channels_last flipped, fused ops off, compile on.

What a trial step does not exercise (:data:`UNTIMED_KEYS`: the loader, DDP communication, process affinity,
the tuning settings) is the pick's in every candidate, plain included: the trial feeds the borrowed batches
itself and runs without DDP, so those knobs could not be told apart; the rules set them.

A variant is only proposed where it can run well: fp16 or bf16 only where the device computes it natively
(``probes.fp16_native`` / ``bf16_native``; emulated half precision runs 7-30x slower on this CPU,
benchmarks/precision_cpu.py), channels_last only for models with Conv2d, and
compile only when the tuning budget can pay for compiling (:data:`COMPILE_MIN_BUDGET_S`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from aiak.strategy.profiles import load_strategy
from aiak.strategy.schema import Strategy
from aiak.strategy.select import leaves, put_leaf
from aiak.tune.gate import is_neutral

# torch.compile spends 10-60 s compiling before its first step on a 2-core CPU (DemoNet: 16.7 s measured with
# torch 2.14), far beyond the default budget (5% of 200 steps); so compile is a candidate only when
# tune.max_seconds allows at least this much.
COMPILE_MIN_BUDGET_S = 60.0
UNTIMED_KEYS = ("loader", "comm", "cpu_affinity", "tune")


@dataclass
class Candidate:
    label: str
    strategy: Strategy
    changes: Dict[str, Any]   # key path -> value, where it differs from plain PyTorch

    @property
    def neutral(self) -> bool:
        return is_neutral(self.changes)


def flatten(data: Dict[str, Any]) -> Dict[str, Any]:
    """``{"precision": {"level": "O1"}}`` -> ``{"precision.level": "O1"}`` (knobs only: no name, match, ...)."""
    return dict(leaves(data))


def differences(strategy: Strategy, base: Strategy) -> Dict[str, Any]:
    """Key paths where ``strategy`` differs from ``base``, with ``strategy``'s values."""
    a, b = flatten(strategy.to_dict()), flatten(base.to_dict())
    return {k: v for k, v in a.items() if b.get(k) != v}


def _variant(pick: Strategy, label: str, changes: Dict[str, Any]) -> Strategy:
    data = pick.to_dict()
    for path, value in changes.items():
        put_leaf(data, path, value)
    data["name"] = f"{pick.name}:{label}"
    return Strategy.from_dict(data, source=f"<candidate {label}>")


def candidate_strategies(pick: Strategy, probes: Any, *, limit: int, max_seconds: Optional[float]) -> List[Candidate]:
    """Up to ``limit`` distinct candidates (plain PyTorch always among them), in order of preference."""
    plain_data = load_strategy("default").to_dict()
    picked = pick.to_dict()
    plain_data.update({key: picked[key] for key in UNTIMED_KEYS}, name="plain")
    plain = Strategy.from_dict(plain_data, source="<candidate plain>")
    changed = differences(pick, plain)
    neutral_changes = {k: v for k, v in changed.items() if is_neutral([k])}
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
    modules = getattr(probes, "modules", {}) or {}
    if modules.get("conv2d"):
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
