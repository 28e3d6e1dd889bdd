"""What composes with a model the script sharded (`aiak.strategy.sharded`): ``auto`` on described machines leaves
each refused knob at ``default.yaml``'s value with its reason, and a named strategy is refused with every problem
at once. The runs on real FSDP2 ranks are in tests/comm/test_sharded.py."""
import warnings

import pytest

from aiak.strategy import StrategyError, load_strategy
from aiak.strategy.select import compose
from aiak.strategy.sharded import check_sharded, refusals
from tests.strategy.test_rules import A100, V100, probes

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


def test_the_language_model_heads_fused_loss_composes_with_the_scripts_fsdp2_alone():
    """A class swap that reads the head's weight inside the forward, where FSDP2 has gathered it (trained on two
    ranks in tests/ops/test_lm_head_training.py); window attention's surgery, FSDP1's flat parameters and a
    tensor-parallel head's vocabulary shards stay refused."""
    lce = load_strategy({"fused_ops": ["linear_cross_entropy"]}).to_dict()
    assert refusals(lce, "fsdp2") == []
    assert [path for path, _ in refusals(lce, "fsdp1")] == [path for path, _ in refusals(lce, "dtensor")] == [
        "fused_ops"]
    both = load_strategy({"fused_ops": ["window_attention", "linear_cross_entropy"]}).to_dict()
    [(path, why)] = refusals(both, "fsdp2")
    assert path == "fused_ops" and "(window_attention)" in why and "linear_cross_entropy alone" in why


def test_fsdp1_refuses_accumulation_layerwise_optimizers_and_counted_items():
    """FSDP1 keeps micro-steps unsynchronised only inside no_sync() and flattens the parameters."""
    data = load_strategy({"grad_accumulation": 4, "optimizer": {"name": "lamb"}}).to_dict()
    assert [path for path, _ in refusals(data, "fsdp1")] == ["grad_accumulation", "optimizer"]
    assert refusals(data, "fsdp2") == []
    with pytest.raises(StrategyError, match="count_items: FSDP1"):
        check_sharded(load_strategy("default").to_dict(), "fsdp1", "default", count_items=True)


def _llm(params, **facts):
    return dict(world_size=8, local_size=8, params=int(params), trainable_params=int(params), optimizer="AdamW",
                **facts)


def test_auto_shards_with_fsdp2_when_the_training_state_takes_half_a_device():
    """Rule ``fsdp2``: parameters + fp32 gradients + AdamW's two moments (16 bytes a parameter) of a 7B model are
    1.3x an 80 GB A100's memory: FSDP2, trials off with the reason; a 1B model (0.19x) stays on DDP, and so does
    the 7B model on one rank (nothing to shard over)."""
    big = probes(**_llm(7e9, **A100))
    assert big.training_state_share == pytest.approx(7e9 * 16 / (79.2 * 2 ** 30))
    selection, said = _composed(**_llm(7e9, **A100))
    assert selection.strategy.comm.engine == "fsdp2" and selection.knobs["comm.engine"].source == "profile:fsdp2"
    assert "training_state_share >=0.5 (found 1.32)" in selection.knobs["comm.engine"].reason
    assert not selection.strategy.tune and "aiak shards the model with FSDP2" in selection.knobs["tune.enabled"].reason
    assert any("no trials" in w for w in said)
    assert _composed(**_llm(1e9, **A100))[0].strategy.comm.engine == "ddp"
    assert _composed(**{**_llm(7e9, **A100), "world_size": 1, "local_size": 1})[0].strategy.comm.engine == "ddp"


def test_the_training_state_share_of_a_cpu_counts_its_local_ranks_and_the_optimizer():
    """On a CPU a device is the host's memory over its local ranks; SGD keeps 4 bytes a parameter, no optimizer
    none; a frozen parameter has no gradient or state."""
    cpu = dict(device="cpu", host_memory_gb=64.0, local_size=4, params=int(1e9), param_bytes=int(2e9))
    assert probes(**cpu, trainable_params=int(1e9), optimizer="SGD").training_state_share == \
        pytest.approx((2e9 + 8e9) / (16 * 2 ** 30))
    assert probes(**cpu, trainable_params=int(5e8)).training_state_share == pytest.approx((2e9 + 2e9) / (16 * 2 ** 30))
    assert probes(device="cpu", params=10).training_state_share == 0.0  # memory unknown


def test_the_probe_reads_a_real_models_bytes_and_this_hosts_memory():
    import torch
    from torch import nn

    from aiak.strategy.probes import probe
    from aiak.util.machine.devices import host_memory_gb

    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5)).to(torch.bfloat16)
    model[1].requires_grad_(False)
    found = probe(model, torch.optim.AdamW(model[0].parameters()))
    assert found.param_bytes == 2 * (220 + 105) and found.host_memory_gb == host_memory_gb() > 0
    assert found.training_state_share == pytest.approx((650 + 12 * 220) / (found.host_memory_gb * 2 ** 30))


def test_aiaks_own_fsdp2_takes_what_applies_before_sharding_and_refuses_the_rest():
    """Under ``comm.engine: fsdp2`` surgery, channels_last and O2 apply (before sharding; O2 as FSDP2's policy);
    trials, fp16 scaling, fp8 layers and DDP's comm settings do not."""
    data = load_strategy({"channels_last": True, "fused_ops": ["window_attention"], "tune": True,
                          "precision": {"level": "O2", "dtype": "bf16", "fp8": "tensorwise"},
                          "comm": {"engine": "fsdp2", "compression": "int8"}}).to_dict()
    assert [path for path, _ in refusals(data, "aiak_fsdp2")] == ["tune", "precision.fp8", "comm.compression"]
    assert [path for path, _ in refusals(data, "fsdp2")][:2] == ["comm.engine", "tune"]  # the script's: no second
