"""The one-screen summary ``optimize()`` logs (logger ``aiak``) and ``aiak explain`` prints.

One line per knob: its value, what was actually done (or why it was skipped), and the reason the strategy
chose it. Nothing here decides anything; it only records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass
class Summary:
    strategy_name: str
    reasons: Dict[str, str] = field(default_factory=dict)
    lines: List[Tuple[str, str, str]] = field(default_factory=list)  # (knob, value, effect)

    def add(self, knob: str, value: object, effect: str) -> None:
        self.lines.append((knob, _fmt(value), effect))

    def effect(self, knob: str) -> str:
        return next((e for k, _, e in self.lines if k == knob), "")

    def render(self, with_reasons: bool = False) -> str:
        width_k = max([len(k) for k, _, _ in self.lines] + [4])
        width_v = min(max([len(v) for _, v, _ in self.lines] + [5]), 28)
        out = [f"aiak.optimize: strategy {self.strategy_name!r}"]
        if "*" in self.reasons:
            out.append(f"  ({self.reasons['*']})")
        for knob, value, effect in self.lines:
            out.append(f"  {knob:<{width_k}}  {value:<{width_v}}  {effect}")
            if with_reasons:
                for key, why in self.reasons.items():
                    if key == knob or key.startswith(knob + "."):
                        label = "" if key == knob else f"{key}: "
                        out.append(f"  {'':<{width_k}}  {'':<{width_v}}  why: {label}{why}")
        return "\n".join(out)


def compact(section: object, always: Tuple[str, ...]) -> Dict[str, object]:
    """A config section as a dict of the ``always`` keys plus every key that differs from its default."""
    import dataclasses

    defaults = type(section)()
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if f.name in always or getattr(section, f.name) != getattr(defaults, f.name)}


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)
