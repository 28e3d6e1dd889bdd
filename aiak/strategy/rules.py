"""The ``match:`` grammar: when a profile takes part in ``strategy="auto"``.

A profile's ``match:`` maps condition keys (the fields of `Match`) to values, and
every condition given must hold: ``modules`` and ``cpu_features`` take a list (all present) or ``{any: [...]}``;
``device`` is ``cpu`` or ``cuda``; ``cuda_capability`` is a comparison such as ``">=8.0"`` (false off CUDA);
``world_size``, ``nodes`` and ``params`` take an integer or a comparison (``">=2"``, ``"<1e8"``);
``fp8_linear_share`` a comparison with a share between 0 and 1 (`aiak.strategy.probes.fp8_linear_share`), as
``training_state_share`` (`aiak.strategy.probes.Probes.training_state_share`); ``lm_head_logits_bytes`` takes an
integer or a comparison (`aiak.strategy.probes.lm_head_logits_bytes`);
``optimizer`` lists class names (any of them, any case); ``variable_length`` and ``loader`` are booleans. An empty list (or
null) is no condition, so ``match: {}`` matches everything. README's section "How ``auto`` chooses: the
``match:`` grammar" is the user's reference, with the meaning of each module kind.

This module checks the values (each field of `Match` names its parser, which the schema's validation
calls, so a bad one is reported with every other problem of the file) and evaluates them against
`Probes` (`match_profile`).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from aiak.strategy.probes import MODULE_KINDS, Probes
from aiak.util.config import Invalid
from aiak.util.text import did_you_mean

DEVICES = ("cpu", "cuda")
COMPARISONS: Dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq, "!=": operator.ne}
_COMPARISON = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*$")
_CAPABILITY = re.compile(r"^[0-9]+(?:\.[0-9]+)?$")


class MatchSyntaxError(Invalid):
    """One bad condition; its text follows the key path in the reported problem (`` must be ...``)."""


# -- parsing: YAML value -> the value kept in ``Match`` (raises MatchSyntaxError) --------------------------
def _strings(value: Any, what: str, choices: Optional[Tuple[str, ...]] = None, *, path: str = "",
             item: str = "entry") -> List[str]:
    """A list of strings (each one of ``choices`` when given); ``path`` is the sub-key the text starts with."""
    if not isinstance(value, list):
        raise MatchSyntaxError(f"{path} must be a list of {what}, got {type(value).__name__} {value!r}")
    for entry in value:
        if not isinstance(entry, str):
            raise MatchSyntaxError(f"{path} must be a list of {what}, got item {entry!r}")
        if choices is not None and entry not in choices:
            raise MatchSyntaxError(f"{path}: unknown {item} {entry!r}{did_you_mean(entry, choices)}; "
                                   f"valid: {list(choices)}")
    return list(value)


def _all_or_any(what: str, choices: Optional[Tuple[str, ...]] = None, item: str = "entry") -> Callable[[Any], Any]:
    """``[x, ...]`` (all of them) or ``{any: [x, ...]}`` (at least one)."""
    def parse(value: Any) -> Any:
        if isinstance(value, dict):
            unknown = [k for k in value if k != "any"]
            if unknown:
                raise MatchSyntaxError(f".{unknown[0]}: unknown key{did_you_mean(unknown[0], ['any'])}; a mapping "
                                       f"takes only 'any' ({{any: [...]}}: at least one present)")
            entries = _strings(value.get("any"), what, choices, path=".any", item=item)
            if not entries:
                raise MatchSyntaxError(f".any needs at least one of the {what}")
            return {"any": entries}
        if not isinstance(value, list):
            raise MatchSyntaxError(f" must be a list of {what} (all present) or {{any: [...]}} (at least one), "
                                   f"got {type(value).__name__} {value!r}")
        return _strings(value, what, choices, item=item)
    return parse


def _device(value: Any) -> str:
    if not isinstance(value, str) or value not in DEVICES:
        raise MatchSyntaxError(f" must be one of {list(DEVICES)}, got {value!r}{did_you_mean(value, DEVICES)}")
    return value


def _comparison(value: Any, example: str, number: Optional[re.Pattern] = None) -> str:
    """``"<op><number>"`` with the spaces dropped; ``number`` narrows what the number may look like."""
    found = _COMPARISON.match(value) if isinstance(value, str) else None
    if found is None or (number is not None and not number.match(found.group(2))):
        raise MatchSyntaxError(f" must be a comparison (a string) such as {example}; operators: "
                               f"{', '.join(COMPARISONS)}; got {value!r}")
    return f"{found.group(1)}{found.group(2)}"


def _capability(value: Any) -> str:
    return _comparison(value, "'>=8.0' or '<9.0'", _CAPABILITY)


def _count(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _comparison(value, "'>=2' or '<1e8'")
    raise MatchSyntaxError(f" must be an integer (matches that number) or a comparison (a string) such as '>=2' "
                           f"or '<1e8'; operators: {', '.join(COMPARISONS)}; got {value!r}")


def _share(value: Any) -> str:
    text = _comparison(value, "'>=0.5'")
    if not 0.0 <= float(_COMPARISON.match(text).group(2)) <= 1.0:
        raise MatchSyntaxError(f" must compare with a share between 0 and 1, such as '>=0.5'; got {value!r}")
    return text


def _optimizers(value: Any) -> List[str]:
    return _strings(value, "optimizer class names (e.g. [AdamW, SGD])")


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise MatchSyntaxError(f" must be true or false, got {value!r}")
    return value


def _condition(parse: Callable[[Any], Any]) -> Dict[str, Any]:
    """Field metadata: the value is checked by ``parse`` (None, YAML ``null``, is no condition)."""
    return {"parse": lambda value: None if value is None else parse(value)}


@dataclass
class Match:
    """When the auto-selector overlays this profile (unused by ``optimize`` with a named strategy): every
    condition given must hold. The grammar is this module's (README: "How ``auto`` chooses");
    an empty list or None is no condition, so ``Match()`` (``match: {}``) matches everything."""

    modules: Union[List[str], Dict[str, List[str]]] = field(
        default_factory=list, metadata=_condition(_all_or_any("module kinds", MODULE_KINDS, item="module kind")))
    device: Optional[str] = field(default=None, metadata=_condition(_device))
    cuda_capability: Optional[str] = field(default=None, metadata=_condition(_capability))
    cpu_features: Union[List[str], Dict[str, List[str]]] = field(
        default_factory=list, metadata=_condition(_all_or_any("CPU flags (as /proc/cpuinfo spells them)")))
    world_size: Union[int, str, None] = field(default=None, metadata=_condition(_count))
    nodes: Union[int, str, None] = field(default=None, metadata=_condition(_count))
    params: Union[int, str, None] = field(default=None, metadata=_condition(_count))
    fp8_linear_share: Optional[str] = field(default=None, metadata=_condition(_share))
    training_state_share: Optional[str] = field(default=None, metadata=_condition(_share))
    lm_head_logits_bytes: Union[int, str, None] = field(default=None, metadata=_condition(_count))
    optimizer: List[str] = field(default_factory=list, metadata=_condition(_optimizers))
    variable_length: Optional[bool] = field(default=None, metadata=_condition(_boolean))
    loader: Optional[bool] = field(default=None, metadata=_condition(_boolean))


# -- evaluation ---------------------------------------------------------------------------------------------
def match_profile(match: Any, probes: Probes) -> Tuple[bool, str]:
    """``(matches, explanation)`` for a validated `Match` against ``probes``.

    The explanation lists each condition with what the probe found (``"device: cpu (found cpu);
    cpu_features any of [avx512_bf16, amx_bf16] (found avx512_bf16)"``) or, when false, the first failing one.
    """
    held = []
    for key, value in ((f.name, getattr(match, f.name)) for f in fields(match)):
        if value is None or value == []:
            continue
        ok, text = _EVALUATORS[key](key, value, probes)
        if not ok:
            return False, text
        held.append(text)
    return True, "; ".join(held) if held else "match: {} (always)"


def _members(key: str, value: Any, present: Dict[str, int], describe: Callable[[str], str]) -> Tuple[bool, str]:
    """All of ``value`` (a list) or any of ``value["any"]`` present (count > 0)."""
    wanted, mode = (value["any"], "any") if isinstance(value, dict) else (value, "all")
    found = [w for w in wanted if present.get(w.lower() if key == "cpu_features" else w, 0)]
    ok = bool(found) if mode == "any" else len(found) == len(wanted)
    label = f"{key}: {wanted[0]}" if len(wanted) == 1 else f"{key} {mode} of [{', '.join(wanted)}]"
    if ok:
        return True, f"{label} (found {', '.join(describe(w) for w in found)})"
    if mode == "any" or len(wanted) == 1:
        return False, f"{label} (found none)"
    return False, f"{label} (missing {', '.join(w for w in wanted if w not in found)})"


def _modules(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    return _members(key, value, probes.modules, lambda kind: f"{probes.modules[kind]} {kind}")


def _cpu_features(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    return _members(key, value, dict.fromkeys(probes.cpu_features, 1), str)


def _device_is(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    return probes.device == value, f"device: {value} (found {probes.device})"


def _compare(text: str, found: Any, parse: Callable[[str], Any]) -> bool:
    op, number = _COMPARISON.match(text).groups()
    return COMPARISONS[op](found, parse(number))


def _cuda_capability(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    capability = probes.cuda_capability
    if capability is None:
        return False, f"cuda_capability {value} (found no CUDA device: model on {probes.device})"
    ok = _compare(value, capability, lambda n: tuple(int(p) for p in (n.split(".") + ["0"])[:2]))
    return ok, f"cuda_capability {value} (found {capability[0]}.{capability[1]})"


def _number(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    found = getattr(probes, key)
    if isinstance(value, int):
        return found == value, f"{key}: {value} (found {found:,})"
    return _compare(value, found, lambda n: float(n.replace("_", ""))), f"{key} {value} (found {found:,})"


def _fraction(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    found = getattr(probes, key)
    return _compare(value, found, float), f"{key} {value} (found {found:.2f})"


def _optimizer(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    label = f"optimizer any of [{', '.join(value)}]"
    if probes.optimizer is None:
        return False, f"{label} (found no optimizer)"
    return probes.optimizer.lower() in {v.lower() for v in value}, f"{label} (found {probes.optimizer})"


def _flag(key: str, value: Any, probes: Probes) -> Tuple[bool, str]:
    if key == "loader":
        found = bool(probes.loader.get("present"))
        return found == value, f"loader: {str(value).lower()} (found {'a loader' if found else 'no loader'})"
    found = probes.loader.get("variable_length")
    if found is None:
        return False, (f"variable_length: {str(value).lower()} (found unknown: no map-style dataset whose samples "
                       "could be measured)")
    return found == value, f"variable_length: {str(value).lower()} (found {str(found).lower()})"


_EVALUATORS: Dict[str, Callable[[str, Any, Probes], Tuple[bool, str]]] = {
    "modules": _modules, "device": _device_is, "cuda_capability": _cuda_capability, "cpu_features": _cpu_features,
    "world_size": _number, "nodes": _number, "params": _number, "fp8_linear_share": _fraction,
    "training_state_share": _fraction, "lm_head_logits_bytes": _number,
    "optimizer": _optimizer,
    "variable_length": _flag, "loader": _flag,
}
