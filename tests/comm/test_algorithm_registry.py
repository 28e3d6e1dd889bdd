"""The registry of comm algorithms is the one place their names live: validation, ``aiak explain``, the knob
table and DDP's wrapping read it, and no module outside ``aiak/comm/algorithms/`` branches on a name."""
import ast
import warnings
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from aiak.comm.algorithms import REGISTRY, AllReduce, CommAlgorithm, algorithm_class
from aiak.comm.config import CommConfig, check_comm
from aiak.strategy import knobs
from aiak.util.config import StrategyError

ROOT = Path(__file__).resolve().parents[2] / "aiak"
ALGORITHMS_DIR = ROOT / "comm" / "algorithms"


def test_each_entry_is_a_comm_algorithm_under_its_own_name_with_what_it_trades():
    for name, cls in REGISTRY.items():
        assert issubclass(cls, CommAlgorithm) and cls.name == name
        assert cls.trades and cls.from_settings is not CommAlgorithm.from_settings
    assert CommConfig().algorithm == AllReduce.name and not AllReduce.changes_training


def test_each_algorithms_settings_section_is_a_field_of_comm_config_and_a_knob_row():
    fields = {f.name: f for f in dataclasses.fields(CommConfig)}
    for name, cls in REGISTRY.items():
        if cls.settings is None:
            continue
        assert name in fields, f"CommConfig has no field {name} for {cls.__name__}'s settings"
        assert isinstance(fields[name].default_factory(), cls.settings)
        assert knobs.knob(f"comm.{name}").changes_training


def test_validation_reads_the_registry_choices_and_each_algorithms_own_problems():
    assert algorithm_class("powersgd") is REGISTRY["powersgd"]
    with pytest.raises(ValueError, match="must be one of .*'allreduce'"):
        algorithm_class("ring")
    with pytest.raises(StrategyError) as e:
        check_comm(CommConfig(algorithm="ring"), "test")
    assert all(name in str(e.value) for name in REGISTRY)
    for name, cls in REGISTRY.items():   # each algorithm's problems, and only its, are reported
        config = CommConfig(algorithm=name, compression="int8", autotune=True)
        problems = cls.problems(config, lambda key: key, "comm.")
        assert (problems == []) == (cls is AllReduce)
        if problems:
            with pytest.raises(StrategyError) as e:
                check_comm(config, "test")
            assert all(p in str(e.value) for p in problems)


def _names_outside_the_registry():
    """String constants equal to an algorithm that changes training, outside ``aiak/comm/algorithms/``, and
    comparisons with the default's name: the branches on names a new algorithm would have to extend."""
    names = {name for name, cls in REGISTRY.items() if cls.changes_training}
    found = []
    for path in ROOT.rglob("*.py"):
        if ALGORITHMS_DIR in path.parents:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == AllReduce.name
                                                     for c in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares with {AllReduce.name!r}")
    return found


def test_no_module_outside_the_algorithms_names_or_branches_on_one():
    assert _names_outside_the_registry() == []


def test_an_algorithm_with_connections_of_its_own_says_comm_connections_does_not_apply():
    """``comm.connections`` is the allreduce route's; decentralized and PowerSGD send over one per peer."""
    topology = SimpleNamespace(world_size=4, num_nodes=2, uniform=True, nodes=[[0, 1], [2, 3]],
                               describe=lambda: "2 nodes x 2")
    own = {name: cls for name, cls in REGISTRY.items() if cls.own_connections}
    assert set(own) == {"decentralized", "powersgd"}
    for name, cls in own.items():
        with pytest.warns(UserWarning, match=f"connections: 4 applies to the allreduce .*; {name} sends over one"):
            assert cls.runs_here(CommConfig(algorithm=name, connections=4), topology, None) is cls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert REGISTRY["local_sgd"].runs_here(CommConfig(algorithm="local_sgd", connections=4), topology,
                                               None) is REGISTRY["local_sgd"]
