"""The settings derived from others and from the ranks: O2's gradients travel in its half dtype on several ranks,
unless the strategy chose another compression or its algorithm averages in fp32; one process derives nothing."""
import pytest

from aiak.comm.algorithms import REGISTRY
from aiak.strategy.derived import Derived, resolve_derived
from aiak.strategy.profiles import load_strategy


def _o2(dtype="bf16", **comm):
    return load_strategy({"precision": {"level": "O2", "dtype": dtype}, "comm": comm})


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_o2_on_several_ranks_sends_its_gradients_in_its_half_dtype(dtype):
    chosen = _o2(dtype)
    resolved, derived = resolve_derived(chosen, world_size=4)
    assert resolved.comm.compression == dtype
    assert derived == [Derived("comm.compression", dtype, f"precision O2 on 4 ranks with comm.algorithm allreduce: "
                                                          f"gradients travel in {dtype}, as apex's O2 did")]
    assert chosen.comm.compression == "none"   # the chosen strategy is left as chosen
    assert resolved.precision == chosen.precision and resolved.loader == chosen.loader


@pytest.mark.parametrize("strategy, world_size", [
    (_o2(), 1),                                                       # one process: no gradients travel
    (_o2(compression="int8"), 4),                                     # a compression chosen is kept
    (load_strategy({"precision": {"level": "O1", "dtype": "bf16"}}), 4),   # O1's gradients are fp32's
    (load_strategy({"precision": {"level": "O2", "dtype": "bf16"}, "comm": {"engine": "fsdp2"}}), 4),  # FSDP2's
])                                                                    # reduce_dtype says how gradients travel
def test_nothing_is_derived_where_the_rule_does_not_hold(strategy, world_size):
    resolved, derived = resolve_derived(strategy, world_size)
    assert (resolved, derived) == (strategy, [])


@pytest.mark.parametrize("name", [name for name, algorithm in REGISTRY.items() if not algorithm.half_gradients])
def test_an_algorithm_averaging_in_fp32_keeps_fp32_gradients_under_o2(name):
    strategy = _o2(algorithm=name)
    assert resolve_derived(strategy, 4) == (strategy, [])
