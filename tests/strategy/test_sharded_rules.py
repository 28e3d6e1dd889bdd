"""What composes with a model the script sharded (`aiak.strategy.sharded`): ``auto`` on described machines leaves
each refused knob at ``default.yaml``'s value with its reason, and a named strategy is refused with every problem
at once. The runs on real FSDP2 ranks are in tests/comm/test_sharded.py."""
import warnings

import pytest

from aiak.strategy import StrategyError, load_strategy
from aiak.strategy.select import compose
from aiak.strategy.sharded import check_sharded, refusals
from tests.strategy.test_rules import V100, probes

CNN_ON_V100 = dict(modules={"conv2d": 20, "batchnorm": 20}, world_size=8, local_size=8, **V100)


def _composed(**facts):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selection = compose(probes(**facts))
    return selection, [str(w.message) for w in caught]


def test_auto_leaves_out_what_fsdp2_refuses_and_says_why():
    """A CNN on a V100 node: the rules pick O2 fp16, channels_last and trials; on the same model sharded by FSDP2
    each of them is back at its default, its reason naming FSDP2 and what to use instead, in one warning."""
    plain, _ = _composed(**CNN_ON_V100)
    assert plain.strategy.channels_last and plain.strategy.precision.level == "O2" and plain.strategy.tune
    sharded, said = _composed(**CNN_ON_V100, sharding="fsdp2")
    s = sharded.strategy
    assert not s.channels_last and s.precision.level == "O0" and s.precision.dtype == "bf16" and not s.tune
    assert s.tf32 and s.loader.prefetch == plain.strategy.loader.prefetch  # what composes stays
    for path in ("channels_last", "precision.level", "tune.enabled"):
        knob = sharded.knobs[path]
        assert knob.source == "default" and "FSDP2" in knob.reason, path
    assert "MixedPrecisionPolicy" in sharded.knobs["precision.level"].reason
    assert len([w for w in said if "sharded by FSDP2" in w]) == 1


def test_auto_on_an_unsharded_model_is_unchanged():
    """The guard acts only on a sharded model: the composition without it is the same strategy."""
    assert _composed(**CNN_ON_V100)[0].strategy == _composed(**CNN_ON_V100, sharding=None)[0].strategy


@pytest.mark.parametrize("sharding", ["fsdp2", "fsdp1", "dtensor"])
def test_default_composes_with_every_engine(sharding):
    """Plain PyTorch's strategy is refused nothing, whoever sharded the model."""
    assert refusals(load_strategy("default").to_dict(), sharding) == []


def test_a_named_strategy_is_refused_with_every_problem():
    data = load_strategy({"channels_last": True, "precision": {"level": "O2", "dtype": "fp16"},
                          "comm": {"algorithm": "powersgd", "hierarchical": True}, "tune": True}).to_dict()
    with pytest.raises(StrategyError) as e:
        check_sharded(data, "fsdp2", "custom")
    assert [p.split(": ")[1] for p in e.value.problems] == [
        "tune", "channels_last", "precision.level", "precision.dtype", "comm.algorithm", "comm.hierarchical"]
    assert all(p.startswith("the strategy given, on a model sharded by FSDP2 (fully_shard)") for p in e.value.problems)


def test_fsdp1_refuses_accumulation_layerwise_optimizers_and_counted_items():
    """FSDP1 keeps micro-steps unsynchronised only inside no_sync() and flattens the parameters."""
    data = load_strategy({"grad_accumulation": 4, "optimizer": {"name": "lamb"}}).to_dict()
    assert [path for path, _ in refusals(data, "fsdp1")] == ["grad_accumulation", "optimizer"]
    assert refusals(data, "fsdp2") == []
    with pytest.raises(StrategyError, match="count_items: FSDP1"):
        check_sharded(load_strategy("default").to_dict(), "fsdp1", "default", count_items=True)
