"""Sections are validated by the types of their fields: a dataclass never seen before is checked without a line
of validation code of its own, every mistake is reported at once, and values come back normalised."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import pytest

from aiak.util.config import Where, build, choices, section_problems


@dataclass
class Inner:
    depth: int = 1


@dataclass
class NewSection:
    flag: bool = False
    count: int = 1
    rate: float = 0.5
    mode: str = field(default="a", metadata=choices("a", "b"))
    limit: Optional[int] = None
    names: List[str] = field(default_factory=list, metadata=choices("x", "y"))
    weights: Optional[List[float]] = None
    scale: Union[str, float] = field(default="auto", metadata=choices("auto", also="<number>"))
    switch: Union[str, bool] = field(default="auto", metadata=choices("auto", True, False))
    extra: Dict[str, int] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)


def _build(data):
    problems = []
    return build(NewSection, data, Where("<test>", {}), "new.", problems), problems


def test_good_values_come_back_normalised():
    built, problems = _build({"flag": True, "count": 3, "rate": 2, "mode": "b", "limit": None, "names": ["y"],
                              "weights": [1, 2.5], "scale": 4, "switch": False, "extra": {"k": 1},
                              "inner": {"depth": 2}})
    assert problems == []
    assert built.rate == 2.0 and isinstance(built.rate, float) and built.weights == [1.0, 2.5]
    assert built.scale == 4.0 and built.switch is False and built.inner == Inner(2)


def test_every_mistake_is_reported_at_once_with_its_path_and_the_valid_choices():
    _, problems = _build({"flag": "yes", "count": True, "rate": "fast", "mode": "c", "limit": 2.5,
                          "names": ["x", "z"], "weights": [], "scale": "big", "switch": 2, "extra": [1],
                          "inner": {"depht": 2}, "unknown": 1})
    text = "\n".join(problems)
    for expected in ["<test>: new.flag must be a boolean, got str 'yes'",
                     "new.count must be an integer, got True",
                     "new.rate must be a number, got str 'fast'",
                     "new.mode must be one of ['a', 'b'], got 'c'",
                     "new.limit must be an integer, got float 2.5",
                     "new.names: unknown entry 'z'",
                     "new.weights must be a non-empty list of numbers, got []",
                     "new.scale must be one of ['auto', '<number>'], got 'big'",
                     "new.switch must be one of ['auto', true, false], got 2",
                     "new.extra must be a mapping, got list [1]",
                     "new.inner.depht: unknown key (did you mean 'depth'?)",
                     "new.unknown: unknown key"]:
        assert expected in text, expected
    assert len(problems) == 12


def test_a_section_built_in_code_is_checked_by_the_same_types():
    assert section_problems(NewSection(count=2), Where("code", {}), "new.") == []
    problems = section_problems(NewSection(count="2", inner=Inner(depth="3")), Where("code", {}), "new.")
    assert problems == ["code: new.count must be an integer, got str '2'",
                        "code: new.inner.depth must be an integer, got str '3'"]


@pytest.mark.parametrize("value", [None, 0, 1.5])
def test_a_required_list_refuses_what_is_not_a_list(value):
    _, problems = _build({"names": value})
    assert problems and "new.names must be a list of strings" in problems[0]
