"""The decision record: what ``optimize()`` applied, every knob's source and reason, and what was measured.

A public contract (code outside this repository reads it): ``aiak.last_decision()``
returns the record of the latest ``optimize()``; ``.to_dict()`` is JSON-ready and holds

* ``strategy``: the applied strategy as a dict, as chosen (what reproduces the run; the settings derived from it
  are in ``knobs``);
* ``knobs``: ``{key path: {"value", "source", "reason"}}``, source one of ``default``, ``profile:<name>``,
  ``measured`` (the trials changed the rules' pick), ``user`` or ``derived`` (set by the strategy's other knobs
  and the run, `aiak.strategy.derived`, such as O2's gradients travelling in the half dtype on several ranks);
* ``trials``: ``[{"strategy", "step_ms", "step_ms_spread", "peak_mem_mb", "grad_cosine", "accepted", "why", ...}]``
  (``peak_mem_mb``: what the candidate's first step added to memory at its peak, `aiak.measure.memory`);
* ``tuning_seconds`` and ``cache_hit``;
* ``guard``: the run-time guard (`aiak.tune.guard`): ``{"chosen", "why"}`` while it watches or where it does not
  run, then its figures (``speedups`` and per-round ``rounds`` of each arm against plain compute, ``steps``,
  ``load``, ``threads``), ``{}`` where the trials chose plain compute or did not run;
* ``comm``: the comm autotuner's candidates and choice (``{"mode", "cache", "cache_hit", "candidates", "chosen"}``,
  `aiak.comm.allreduce.autotune.CommTuning`), or ``None`` without it; read when asked, so a step-mode choice
  made during the first steps shows once made;

plus ``matched`` / ``not_matched`` (the profiles' rules), ``probes`` and ``tuning`` (why nothing was measured, if
so: no trial ran, or every candidate failed; a knob is ``measured`` only when a trial chose it).
`Decision.render` is the one table the ``aiak`` logger prints at ``optimize()`` and ``aiak explain`` shows.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aiak.amp.fp8 import TRADES as FP8_TRADES
from aiak.apply import skipped_reason
from aiak.comm.algorithms import algorithm_class
from aiak.strategy.schema import Strategy, called
from aiak.strategy.select import leaves
from aiak.strategy.sharded import sharded_by, what_auto_leaves_out
from aiak.tune.guard import PLAIN as PLAIN_COMPUTE
from aiak.tune.candidates import differences
from aiak.util.text import yaml_text

_last: Optional["Decision"] = None


@dataclass
class Decision:
    strategy: Dict[str, Any]
    knobs: Dict[str, Dict[str, Any]]
    trials: List[Dict[str, Any]] = field(default_factory=list)
    tuning_seconds: float = 0.0
    cache_hit: bool = False
    matched: List[str] = field(default_factory=list)
    not_matched: Dict[str, str] = field(default_factory=dict)
    probes: Dict[str, Any] = field(default_factory=dict)
    tuning: str = ""
    effects: List[List[str]] = field(default_factory=list)   # [knob, value, what was done] from the summary
    comm: Any = None   # the comm autotuner's record (to_dict(), lines()), filled as it measures
    guard: Dict[str, Any] = field(default_factory=dict)  # the run-time guard's standing, then its figures

    def effect(self, knob: str) -> str:
        """What applying ``knob`` (a key path, or a section such as ``comm``) did: its own line of the summary or
        its section's (``""`` if the applier said nothing of it)."""
        return next((e for k, _, e in self.effects if k == knob),
                    next((e for k, _, e in self.effects if _covers(k, knob)), ""))

    def to_dict(self) -> Dict[str, Any]:
        return json.loads(json.dumps({
            "strategy": self.strategy, "knobs": self.knobs, "trials": self.trials,
            "tuning_seconds": self.tuning_seconds, "cache_hit": self.cache_hit, "matched": self.matched,
            "not_matched": self.not_matched, "probes": self.probes, "tuning": self.tuning,
            "comm": self.comm.to_dict() if self.comm is not None else None, "guard": self.guard},
            default=_jsonable))

    def render(self, full: bool = False, group_defaults: bool = False) -> str:
        """The table: knobs (value, source, reason), trials, what each step did.

        ``full=False`` (the log ``optimize()`` prints) leaves out the knobs still at plain PyTorch's defaults and
        groups the others by what set them: the source and the words their reasons share once, as a heading,
        then each knob with its value and what is its own (a profile sets many knobs for one reason).
        ``full=True`` (``aiak explain``) is the complete table: every knob on its own row, with its value, source
        and whole reason; with ``group_defaults`` (``aiak explain``) the knobs set away from the defaults are
        grouped as in the log, and those at plain PyTorch's defaults are named on a few lines by section."""
        name = self.strategy.get("name", "?")
        out = [f"aiak.optimize: strategy {name!r}"
               + (f"; rules matched: {', '.join(self.matched)}" if self.matched else "")]
        shown = {p: k for p, k in self.knobs.items() if full or k["source"] != "default"}
        for path, why in self.changed_knobs().items():   # a knob its applier skipped: its row says so first
            if why and path in shown:
                shown[path] = dict(shown[path], reason=f"skipped ({why}); {shown[path]['reason']}")
        if full and group_defaults:
            out += _knob_groups({p: k for p, k in shown.items() if k["source"] != "default"})
            out += _default_groups([p for p, k in shown.items() if k["source"] == "default"])
        elif full:
            out += _knob_table(shown)
        else:
            out += _knob_groups(shown)
            if len(shown) < len(self.knobs):
                out.append(f"  ({len(self.knobs) - len(shown)} other knobs at plain PyTorch's defaults; "
                           f"`aiak explain` lists every one)")
        if self.trials:
            head = "cached trials" if self.cache_hit else "trials"
            out.append(f"  {head} ({self.tuning_seconds:.2f} s{', cache hit: none run now' if self.cache_hit else ''}):")
            out.append(f"    {'candidate':<22} {'step ms':>8} {'spread':>15} {'vs plain':>8} {'peak MiB':>9} "
                       f"{'grad cos':>9}  verdict")
            for t in self.trials:
                ms = f"{t['step_ms']:.2f}" if t["step_ms"] else "-"
                spread = "-" if not t["step_ms_spread"] else f"{t['step_ms_spread'][0]:.1f}-{t['step_ms_spread'][1]:.1f}"
                ratio = f"{t['speedup']:.2f}x" if t.get("speedup") else "-"
                peak = f"{t['peak_mem_mb']:.0f}" if t.get("peak_mem_mb") is not None else "-"
                cos = f"{t['grad_cosine']:.5f}" if t.get("grad_cosine") is not None else "-"
                verdict = ("kept: " if t["accepted"] else "dropped: ") + t["why"]
                label = "plain-compute" if t["label"] == "plain" else t["label"]  # one word: the columns split
                out.append(f"    {label:<22} {ms:>8} {spread:>15} {ratio:>8} {peak:>9} {cos:>9}  {verdict}")
            out.append("    (every candidate, plain-compute too, runs with the pick's loader and training knobs, "
                       "which no trial decides)")
        if self.tuning:
            out.append(f"  trials: {self.tuning}")
        if self.guard:
            out.append(f"  run-time guard: {guard_line(self.guard)}")
        if self.comm is not None:
            out += [f"  {line}" for line in self.comm.lines()]
        effects = [e for e in self.effects if full or any(_covers(e[0], p) for p in shown)]
        if effects:
            out.append("  applied:")
            width = max(len(k) for k, _, _ in effects)
            out += [f"    {k:<{width}}  {effect}" for k, _, effect in effects]
        return "\n".join(out)

    def headline(self) -> str:
        """Two lines for the log: the strategy applied, its knobs that differ from plain PyTorch (compact) and
        what the trials did; then where to read why."""
        name = self.strategy.get("name", "?")
        how = f"rules: {', '.join(self.matched)}" if self.matched else ""
        chosen = next((t["label"] for t in self.trials if "chosen" in t.get("why", "")), None)
        if chosen is not None:
            trials = (f"{'cached trials' if self.cache_hit else 'trials'} {candidate_words(chosen, self.trials)}"
                      f" of {len(self.trials)} measured")
        elif any(t["accepted"] and "timed in the run" in t.get("why", "") for t in self.trials):
            kept = sum(t["accepted"] for t in self.trials)
            trials = f"trials kept {kept} of {len(self.trials)} candidates, timed in the run's first steps"
        elif self.tuning.startswith("skipped: "):
            trials = "trials skipped"
        elif self.tuning and self.trials:  # they ran and every candidate failed
            trials = "trials measured nothing: every candidate failed"
        else:
            trials = ""
        changed = self.changed_knobs()
        skipped = {path: why for path, why in changed.items() if why}
        knobs = [f"{path}={yaml_text(self.knobs[path]['value'])}" for path, why in changed.items() if not why]
        shown = ", ".join(knobs[:HEADLINE_KNOBS]) + (f", +{len(knobs) - HEADLINE_KNOBS} more"
                                                     if len(knobs) > HEADLINE_KNOBS else "")
        context = "; ".join(part for part in (how, trials) if part)
        skipped_text = "; skipped: " + "; ".join(f"{path} ({why})" for path, why in skipped.items()) if skipped else ""
        return (f"aiak: applied {called(name)}" + (f" ({context})" if context else "")
                + f": {shown or 'plain PyTorch'}{skipped_text}\n"
                + "aiak: the reason for each knob: aiak.last_decision().render(), or `aiak explain` for a model spec")

    def changed_knobs(self) -> Dict[str, str]:
        """The knobs a strategy or the trials set away from plain PyTorch, each with ``""`` if it was applied
        or why it was skipped (the applier's words). Left out: ``tune.*`` (the trials say what they did),
        values equal to plain PyTorch's, and what acts only with another knob (``precision.dtype`` and
        ``loss_scale`` at level O0). ``precision.dtype`` is always named at O1/O2: it says which half."""
        half = self.knobs.get("precision.level", {}).get("value", "O0") != "O0"

        def named(path: str, k: Dict[str, Any]) -> bool:
            if path == "precision.dtype" and half:   # which half precision: said whatever set it
                return True
            inert = path.startswith("precision.") and path != "precision.level" and not half
            return not (k["source"] == "default" or path.startswith("tune.") or inert
                        or k["value"] == PLAIN.get(path, object()))

        return {path: skipped_reason(self.effect(path)) or "" for path, k in self.knobs.items() if named(path, k)}


def candidate_words(label: str, trials: Sequence[Dict[str, Any]]) -> str:
    """What the trials chose, in words: the rules' pick (the first candidate, `aiak.tune.candidates`), plain compute,
    the pick's numerics-neutral knobs, or the pick with one knob changed (its label)."""
    if label == "plain":
        return "chose plain compute"
    if trials and label == trials[0]["label"]:
        return "kept the rules' pick"
    if label == "neutral":
        return "chose the pick's numerics-neutral knobs"
    return f"chose the pick with {label}"


def guard_line(guard: Dict[str, Any]) -> str:
    """The run-time guard's standing or figures (`aiak.tune.guard`) on one line."""
    if "speedups" not in guard:
        return guard.get("why", "")
    figures = ", ".join(f"{label} {s:.2f}x" for label, s in guard["speedups"].items() if label != PLAIN_COMPUTE)
    return (f"{guard['chosen']} over the first {guard['steps']} steps ({figures} of plain compute's speed, "
            f"alternating windows); {guard['why']}")


def _covers(key: str, path: str) -> bool:
    """Whether the summary's line ``key`` (a knob, or a whole section) speaks for the knob ``path``."""
    return path == key or path.startswith(key + ".")


HEADLINE_KNOBS = 8  # knobs named in the headline; the rest are counted
PLAIN: Dict[str, Any] = dict(leaves(Strategy().to_dict()))  # every knob's plain PyTorch value


def _knob_table(knobs: Dict[str, Dict[str, Any]]) -> List[str]:
    """One row per knob: path, value, source, whole reason."""
    rows = [(path, yaml_text(k["value"]), k["source"], k["reason"]) for path, k in knobs.items()]
    widths = [max(len(r[i]) for r in rows + [("knob", "value", "source", "")]) for i in range(3)]
    widths[1] = min(widths[1], 24)
    out = [f"  {'knob':<{widths[0]}}  {'value':<{widths[1]}}  {'source':<{widths[2]}}  reason"]
    for path, value, source, reason in rows:
        out.append(f"  {path:<{widths[0]}}  {value:<{widths[1]}}  {source:<{widths[2]}}  {reason}")
    return out


def _default_groups(paths: List[str]) -> List[str]:
    """The knobs left at plain PyTorch's defaults, one line per section: ``comm (27): algorithm, ...``."""
    if not paths:
        return []
    sections: Dict[str, List[str]] = {}
    for path in paths:
        head, _, rest = path.partition(".")
        sections.setdefault(head if rest else "", []).append(rest or path)
    out = [f"  at plain PyTorch's defaults ({len(paths)} knobs; `aiak explain --all` gives each its row):"]
    for section, names in sections.items():
        label = f"{section} ({len(names)})" if section else "top level"
        out.append(f"    {label}: {', '.join(names)}")
    return out


def _knob_groups(knobs: Dict[str, Dict[str, Any]]) -> List[str]:
    """The knobs grouped by source (in order of first appearance): ``from <source>: <shared reason>``, then one
    indented row per knob with its value and the rest of its own reason."""
    groups: Dict[str, List[str]] = {}
    for path, k in knobs.items():
        groups.setdefault(k["source"], []).append(path)
    width = max((len(path) for path in knobs), default=0)
    value_width = min(max((len(yaml_text(k["value"])) for k in knobs.values()), default=0), 24)
    out = []
    for source, paths in groups.items():
        shared, own = _shared_reason([knobs[p]["reason"] for p in paths])
        out.append(f"  from {source}: {shared}" if shared else f"  from {source}:")
        for path, tail in zip(paths, own):
            out.append(f"    {path:<{width}}  {yaml_text(knobs[path]['value']):<{value_width}}  {tail}".rstrip())
    return out


def _shared_reason(reasons: List[str]) -> Tuple[str, List[str]]:
    """The words every reason starts with, cut where a clause ends (``; ``, `` (``), and what is left of each:
    ``["set by profile 'swin' (default: false)", "set by profile 'swin' (default: O0)"]`` ->
    ``("set by profile 'swin'", ["(default: false)", "(default: O0)"])``."""
    if len(set(reasons)) == 1:
        return reasons[0], [""] * len(reasons)
    prefix = os.path.commonprefix(reasons)
    cut = len(prefix) if prefix in reasons else max(prefix.rfind("; "), prefix.rfind(" ("))
    if cut <= 0:
        return "", reasons
    return prefix[:cut], [r[cut:].lstrip("; ").lstrip() for r in reasons]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def build(selection: Any, applied: Any, tuning: Any = None, summary: Any = None, comm: Any = None,
          derived: Sequence[Any] = ()) -> Decision:
    """The record of one ``optimize()``: ``selection`` (the rules), ``applied`` (the Strategy applied, as chosen),
    ``tuning`` (`aiak.tune.trials.Tuning` or None), ``summary`` (what each step did), ``comm`` (the comm
    autotuner's `CommTuning`, or None), ``derived`` (the settings derived
    for this run, `aiak.strategy.derived.Derived`: each knob's row says so)."""
    measured = differences(tuning.strategy, selection.strategy) if tuning is not None else {}  # the trials' changes
    trials = [t.to_dict() for t in tuning.trials] if tuning is not None else []
    winner = next((t for t in trials if "chosen" in t["why"]), None)
    failed_all = bool(trials) and not any(t["accepted"] for t in trials)  # plain PyTorch compute was applied
    knobs: Dict[str, Dict[str, Any]] = {}
    for path, value in leaves(applied.to_dict()):
        knob = selection.knobs.get(path)
        if path in measured and failed_all:
            knobs[path] = {"value": value, "source": "default",
                           "reason": f"every trial failed, so plain PyTorch's setting (nothing unverified is "
                                     f"applied); the rules' pick had {yaml_text(knob.value) if knob else '?'}"}
        elif path in measured:
            how = "cached decision of earlier trials" if tuning.cache_hit else "trials"
            if winner is not None and winner["step_ms"]:
                chose = f"candidate {tuning.label!r} was the fastest accepted at {winner['step_ms']:.2f} ms/step"
            else:  # a cache entry without its measurements: say what was chosen, claim no timing
                chose = f"candidate {tuning.label!r} was chosen"
            reason = f"{how}: {chose}; the rules' pick had {yaml_text(knob.value) if knob else '?'}"
            knobs[path] = {"value": value, "source": "measured", "reason": reason}
        elif knob is not None:
            knobs[path] = {"value": value, "source": knob.source, "reason": knob.reason}
        else:
            knobs[path] = {"value": value, "source": "default", "reason": "plain PyTorch's setting"}
    for setting in derived:
        knobs[setting.path] = {"value": setting.value, "source": "derived", "reason": setting.reason}
    algorithm = knobs.get("comm.algorithm")
    synchronising = algorithm_class(algorithm["value"]) if algorithm is not None else None
    if synchronising is not None and synchronising.changes_training:  # say what it trades
        algorithm["reason"] += f"; trades: {synchronising.trades}"
    fp8 = knobs.get("precision.fp8")
    if fp8 is not None and fp8["value"] != "off":
        fp8["reason"] += f"; trades: {FP8_TRADES}"
    probes = selection.probes.to_dict() if hasattr(selection.probes, "to_dict") else {}
    tuning_note = ""
    if tuning is None:
        tuning_note = "off (tune: false)" if not getattr(selection.strategy, "tune", False) else "not run"
        sharding = sharded_by(selection.strategy.to_dict(), getattr(selection.probes, "sharding", None),
                              getattr(selection.probes, "world_size", 1))
        if sharding and selection.strategy.name == "auto":
            tuning_note = f"off: {what_auto_leaves_out(sharding)}, and the trials would time copies of it"
    elif tuning.skipped:  # trials that ran but measured nothing say why themselves
        tuning_note = tuning.skipped if tuning.trials else f"skipped: {tuning.skipped}"
    elif tuning.remeasured:
        tuning_note = tuning.remeasured
    effects = [list(line) for line in summary.lines] if summary is not None else []
    return Decision(strategy=applied.to_dict(), knobs=knobs, trials=trials,
                    tuning_seconds=tuning.seconds if tuning is not None else 0.0,
                    cache_hit=bool(tuning is not None and tuning.cache_hit), matched=list(selection.matched),
                    not_matched=dict(selection.skipped), probes=probes, tuning=tuning_note, effects=effects,
                    comm=comm)


def record(decision: Decision) -> None:
    global _last
    _last = decision


def last_decision() -> Optional[Decision]:
    """The record of the most recent ``optimize()`` (None before the first)."""
    return _last
