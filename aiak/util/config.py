"""Configuration sections as dataclasses, checked by the types of their fields.

Each subsystem owns the section of the strategy it reads (``amp.config.Precision``, ``comm.config.CommConfig``,
...); `aiak.strategy.schema` composes them into the ``Strategy``. `build` makes a section from the
YAML's mapping: a field's type hint (``bool``, ``int``, ``float``, ``str``, ``List[...]``, ``Dict[str, Any]``,
``Optional[...]``, ``Union[...]``, a nested section) says what is valid, ``metadata["choices"]`` narrows it, and
``metadata["parse"]`` hands the value to a parser of its own (the ``match:`` grammar). A section's own
``_problems(where, path)`` checks ranges and combinations of its keys once their types are right. So a new knob
is one new field of a type below, and every mistake of a file is collected and reported at once.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Union

from aiak.util.text import did_you_mean, yaml_text


class StrategyError(ValueError):
    """Bad strategy input: every mistake found, raised at once.

    One error listing every mistake saves a run per mistake; each names its source (a file, or `<dict>`), the dotted
    key path and what would be valid (with "did you mean"). A `ValueError`, so code that catches bad values catches
    it too.

    Args:
        problems: one problem, or the list of them; the message shows them all.

    Attributes:
        problems: the list of problems, one string each.
    """

    def __init__(self, problems: Union[str, List[str]]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the strategy:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


class Invalid(Exception):
    """One bad value; the text follows the key path in the reported problem."""


def choices(*values: Any, also: str = "") -> Dict[str, Any]:
    """Field metadata: the valid values (``also``: what else is valid, in words, for the error message)."""
    return {"choices": tuple(values), "also": also}


@dataclass(frozen=True)
class Where:
    """Where a key came from: the file that set it (``origins``), else the strategy's own source."""

    source: str
    origins: Mapping[str, str]

    def source_of(self, path: str) -> str:
        key = path.rstrip(".")
        while key and key not in self.origins:
            key = key.rpartition(".")[0]
        return self.origins.get(key, self.source)

    def __call__(self, path: str) -> str:
        return f"{self.source_of(path)}: {path.rstrip('.') or '<top level>'}"


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> Dict[str, Any]:
    """The resolved type hints of a dataclass's fields (annotations are strings under ``from __future__``)."""
    return typing.get_type_hints(cls)


_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def type_name(hint: Any) -> str:
    """``"an integer"``, ``"a list of numbers"``: a type hint in the words of an error message."""
    if typing.get_origin(hint) is list:
        item = (typing.get_args(hint) or (Any,))[0]
        return "a list of " + {float: "numbers", int: "integers", str: "strings"}.get(item, "values")
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _spelled(options: tuple, also: str) -> str:
    """``['auto', true, false]``: the choices as the YAML would spell them, strings quoted."""
    words = [repr(o) if isinstance(o, str) else yaml_text(o) for o in options] + ([repr(also)] if also else [])
    return "[" + ", ".join(words) + "]"


def check_value(value: Any, hint: Any, metadata: Mapping[str, Any] = MappingProxyType({})) -> Any:
    """``value`` checked against the type ``hint`` and ``metadata["choices"]``; returned normalised (ints given
    for a float become floats) or `Invalid` raised with what would be valid."""
    options, also = tuple(metadata.get("choices", ())), metadata.get("also", "")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        members = [a for a in args if a is not type(None)]
        if value is None and len(members) < len(args):
            return None
        if len(members) == 1:
            return check_value(value, members[0], metadata)
        member = next((m for m in members if _is_a(value, m)), None)
        if member is None or (options and member in (str, bool) and value not in options):
            raise Invalid(f" must be one of {_spelled(options, also)}, got {value!r}{did_you_mean(value, options)}")
        return _scalar(value, member, (), "")
    if origin is list:
        item = (args or (Any,))[0]
        if not isinstance(value, list):
            raise Invalid(f" must be {type_name(hint)}, got {type(value).__name__} {value!r}")
        if item is float and (not value or not all(_is_a(v, float) for v in value)):
            raise Invalid(f" must be a non-empty list of numbers, got {value!r}")
        for v in value:
            if item is not Any and not _is_a(v, item):
                raise Invalid(f" must be {type_name(hint)}, got item {v!r}")
            if options and v not in options:
                raise Invalid(f": unknown entry {v!r}{did_you_mean(v, options)}; valid choices: {list(options)}")
        return [float(v) for v in value] if item is float else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise Invalid(f" must be a mapping, got {type(value).__name__} {value!r}")
        return value
    return _scalar(value, hint, options, also)


def _is_a(value: Any, hint: Any) -> bool:
    """``isinstance`` as YAML means it: a bool is no number, an int is a float."""
    if hint is Any:
        return True
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _scalar(value: Any, hint: Any, options: tuple, also: str) -> Any:
    if not _is_a(value, hint):
        got = repr(value) if isinstance(value, bool) else f"{type(value).__name__} {value!r}"
        raise Invalid(f" must be {type_name(hint)}, got {got}")
    if options and value not in options:
        raise Invalid(f" must be one of {_spelled(options, also)}, got {value!r}{did_you_mean(value, options)}")
    return float(value) if hint is float else value


def is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def build(cls: type, data: Any, where: Where, path: str, problems: List[str]) -> Any:
    """An instance of the section ``cls`` from ``data``; every bad key is appended to ``problems`` (and left at
    its default) so that all mistakes are reported together."""
    if not isinstance(data, Mapping):
        shape = getattr(cls, "_SHAPE", "a mapping")
        problems.append(f"{where(path)} must be {shape}, got {type(data).__name__} {data!r}")
        return cls()
    before = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = field_types(cls)
    rest = next((f for f in fields.values() if f.metadata.get("rest")), None)
    known = [n for n, f in fields.items() if not f.metadata.get("rest")]
    kwargs: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    nested = 0  # problems found inside nested sections: they do not keep this section's ranges from being checked
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"{where(path)}: key {key!r}: keys must be strings")
            continue
        if key not in known:
            if rest is not None:
                extra[key] = value
                continue
            problems.append(f"{where(path + key)}: unknown key{did_you_mean(key, known)}; valid keys: {known}")
            continue
        f, hint = fields[key], hints[key]
        if is_section(hint):
            inside = len(problems)
            kwargs[key] = build(hint, getattr(hint, "normalise", lambda v: v)(value), where, f"{path}{key}.",
                                problems)
            nested += len(problems) - inside
            continue
        try:
            parse = f.metadata.get("parse")
            kwargs[key] = parse(value) if parse is not None else check_value(value, hint, f.metadata)
        except Invalid as e:
            problems.append(f"{where(path + key)}{e}")
    if rest is not None:
        kwargs[rest.name] = extra
    built = cls(**kwargs)
    check_section = getattr(built, "_problems", None)
    if check_section is not None and len(problems) - nested == before:  # needs the section's own keys valid
        problems.extend(check_section(where, path))
    return built


def section_problems(section: Any, where: Where, path: str) -> List[str]:
    """Every problem of a section built in code (not from YAML), found as `build` finds those of a file."""
    problems: List[str] = []
    build(type(section), dataclasses.asdict(section), where, path, problems)
    return problems
