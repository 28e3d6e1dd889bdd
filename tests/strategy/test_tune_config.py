"""The ``tune`` key: ``true | false`` or ``{enabled, candidates, steps, max_seconds, guard}``, merged through
``extends``."""
import textwrap

import pytest

from aiak.strategy import Strategy, StrategyError, TuneConfig, load_strategy


@pytest.mark.parametrize("written, expected", [
    (False, TuneConfig(enabled=False)),
    (True, TuneConfig(enabled=True)),
    ({}, TuneConfig(enabled=True)),                                   # a mapping means enabled...
    ({"candidates": 2, "max_seconds": 30}, TuneConfig(True, 2, 3, 30.0)),
    ({"enabled": False, "steps": 5}, TuneConfig(False, 4, 5, None)),  # ...unless it says enabled: false
    ({"max_seconds": None}, TuneConfig(enabled=True)),
])
def test_tune_accepts_a_boolean_or_a_mapping(written, expected):
    tune = load_strategy({"tune": written}).tune
    assert tune == expected and bool(tune) is expected.enabled
    assert isinstance(tune.max_seconds, (float, type(None)))


def test_bool_of_tune_is_enabled_so_existing_checks_keep_working():
    assert not load_strategy("default").tune
    assert load_strategy({"tune": {"candidates": 1}}).tune
    assert not TuneConfig() and TuneConfig(enabled=True)


def test_to_dict_gives_the_mapping_and_round_trips(tmp_path):
    s = load_strategy({"tune": {"candidates": 6, "max_seconds": 12.5}})
    assert s.to_dict()["tune"] == {"enabled": True, "candidates": 6, "steps": 3, "max_seconds": 12.5, "guard": True}
    assert Strategy.from_dict(s.to_dict()) == s
    path = tmp_path / "t.yaml"
    path.write_text(s.to_yaml())
    assert load_strategy(str(path)).tune == s.tune


def test_extends_merges_a_boolean_over_a_parents_mapping(tmp_path):
    (tmp_path / "parent.yaml").write_text("tune: {candidates: 8, max_seconds: 30}\n")
    (tmp_path / "off.yaml").write_text("extends: parent.yaml\ntune: false\n")
    (tmp_path / "on.yaml").write_text("extends: off.yaml\ntune: true\n")
    (tmp_path / "steps.yaml").write_text("extends: off.yaml\ntune: {steps: 5}\n")
    assert load_strategy(str(tmp_path / "parent.yaml")).tune == TuneConfig(True, 8, 3, 30.0)
    assert load_strategy(str(tmp_path / "off.yaml")).tune == TuneConfig(False, 8, 3, 30.0)
    assert load_strategy(str(tmp_path / "on.yaml")).tune == TuneConfig(True, 8, 3, 30.0)
    assert load_strategy(str(tmp_path / "steps.yaml")).tune == TuneConfig(True, 8, 5, 30.0)
    assert load_strategy({"extends": "auto_base", "tune": False}).tune == TuneConfig(False, 4, 3, None)


def test_auto_base_turns_the_trials_on():
    assert load_strategy("auto_base").tune == TuneConfig(enabled=True, candidates=4, steps=3)


@pytest.mark.parametrize("written, message", [
    ("yes", r"<dict>: tune must be true, false or a mapping \{enabled, candidates, steps, max_seconds, guard\}, "
            r"got str 'yes'"),
    (1, r"<dict>: tune must be true, false or a mapping"),
    ({"candidates": 0}, r"<dict>: tune.candidates must be >= 1, got 0"),
    ({"steps": -1}, r"<dict>: tune.steps must be >= 1, got -1"),
    ({"max_seconds": 0}, r"<dict>: tune.max_seconds must be > 0 seconds or null \(no limit\), got 0"),
    ({"candidates": 2.5}, r"<dict>: tune.candidates must be an integer"),
    ({"enabled": "on"}, r"<dict>: tune.enabled must be a boolean"),
    ({"candidate": 2}, r"<dict>: tune.candidate: unknown key \(did you mean 'candidates'\?\); valid keys: "
                       r"\['enabled', 'candidates', 'steps', 'max_seconds', 'guard'\]"),
])
def test_bad_tune_values_are_reported(written, message):
    with pytest.raises(StrategyError, match=message):
        load_strategy({"tune": written})


def test_every_tune_mistake_is_reported_at_once_naming_the_file(tmp_path):
    (tmp_path / "parent.yaml").write_text("tune: {steps: 0}\n")
    child = tmp_path / "child.yaml"
    child.write_text(textwrap.dedent("""
        extends: parent.yaml
        tune: {candidates: 0, max_seconds: -3}
    """))
    with pytest.raises(StrategyError) as err:
        load_strategy(str(child))
    assert err.value.problems == [f"{child}: tune.candidates must be >= 1, got 0",
                                  f"{tmp_path / 'parent.yaml'}: tune.steps must be >= 1, got 0",
                                  f"{child}: tune.max_seconds must be > 0 seconds or null (no limit), got -3.0"]
