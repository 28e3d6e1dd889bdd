"""What each step of ``apply_strategy`` actually did, knob by knob: the "applied" part of the decision record
(:mod:`aiak.tune.decision`, which ``optimize()`` logs and ``aiak explain`` prints). Nothing here decides
anything; it only records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass
class Summary:
    lines: List[Tuple[str, str, str]] = field(default_factory=list)  # (knob, value, effect)

    def add(self, knob: str, value: object, effect: str) -> None:
        self.lines.append((knob, _fmt(value), effect))

    def effect(self, knob: str) -> str:
        return next((e for k, _, e in self.lines if k == knob), "")


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
