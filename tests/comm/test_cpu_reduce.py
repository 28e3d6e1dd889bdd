"""CPU-Reduce (``comm.cpu_reduce``): the hierarchical algorithm with its cross-node stage on host copies over a gloo
group of its own. On this machine the gradients already live on the host, so what is tested is the staging (the
copy out, the sum on the host group, the copy back) and that nothing else changes; the CUDA copies have a row in
benchmarks/gpu_check.py."""
import pytest
import torch

from aiak.comm.allreduce.autotune import CommChoice, TuneInputs, algorithm_candidates
from aiak.comm.config import CommConfig
from aiak.strategy.schema import Strategy, StrategyError


@pytest.fixture(scope="module")
def ranks(launch_ranks):
    return launch_ranks("cpu_reduce", world=4, timeout=180)


def _expected(step):
    return sum(torch.randint(-8, 9, (100_003,), generator=torch.Generator().manual_seed(10 * r + step)).float()
               for r in range(4))


def _crossing(calls):
    return [c for c in calls if c[1] in {(0, 2), (1, 3)}]


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_cpu_reduce_gives_bit_identical_sums_and_crosses_nodes_only_on_its_host_group(ranks, compression):
    for r in ranks:
        assert r["host_is_its_own_group"]
        nccl_like, host = r[(compression, False)], r[(compression, True)]
        for step in range(2):
            assert torch.equal(nccl_like["results"][step], _expected(step))
            assert torch.equal(host["results"][step], _expected(step))
        assert host["describe"] == "hierarchical (CPU-Reduce)" + ("" if compression == "none" else f"+{compression}")
        # the same collectives (sizes, dtypes on the wire), but every cross-node one on the host group, none else
        assert host["calls"] == nccl_like["calls"]
        crossing = [on for c, on in zip(host["calls"], host["on_host_group"]) if c in _crossing(host["calls"])]
        assert crossing and all(crossing)
        assert sum(host["on_host_group"]) == len(_crossing(host["calls"]))
        assert not any(nccl_like["on_host_group"])


def test_int8_over_the_host_is_the_same_as_int8_on_the_device_group(ranks):
    """The same quantization, residuals and order: bit-identical to int8 hierarchical, on every rank."""
    for r in ranks:
        for step in range(2):
            assert torch.equal(r[("int8", True)]["results"][step], r[("int8", False)]["results"][step])
            assert (r[("int8", True)]["results"][step] - _expected(step)).abs().max() <= 4 * (64 / 255)
    assert all(torch.equal(r[("int8", True)]["results"][1], ranks[0][("int8", True)]["results"][1]) for r in ranks)


def test_on_a_gloo_job_cpu_reduce_says_why_it_cannot_apply(ranks):
    wrapped = ranks[0]["gloo_wrap"]
    assert wrapped["describe"] == "hierarchical"
    assert any("comm.cpu_reduce=true applies to CUDA gradients on NCCL" in w for w in wrapped["warnings"])


def test_the_autotuner_measures_cpu_reduce_beside_the_device_stages_and_records_every_candidate(ranks):
    records = [r["tuned"]["record"] for r in ranks]
    assert all(rec == records[0] for rec in records)   # the slowest rank's figures, the same on every rank
    measured = [c["candidate"] for c in records[0]["candidates"]]
    expected = [CommChoice(h, c, 0.001, k, host).describe() for h, c, k, host in algorithm_candidates(True, False,
                                                                                                      cpu_reduce=True)]
    assert measured == expected and sum("CPU-Reduce" in m for m in measured) == 3
    assert sum(c["chosen"] for c in records[0]["candidates"]) == 1
    assert all(c["ms_spread"][0] <= c["ms"] <= c["ms_spread"][1] and c["ms"] > 0 for c in records[0]["candidates"])
    chosen = next(c["candidate"] for c in records[0]["candidates"] if c["chosen"])
    assert chosen == records[0]["chosen"] == ranks[0]["tuned"]["choice"]


def test_cpu_reduce_candidates_only_where_the_run_allows_them():
    nccl = TuneInputs.of(CommConfig(perf_mode="step"), 4, 2, "cuda", groups=True, cpu_reduce=True)
    assert (True, "fp16", 1, True) in nccl.candidates()
    assert not any(c[3] for c in TuneInputs.of(CommConfig(perf_mode="step"), 4, 2, "cuda", groups=True).candidates())
    choice = CommChoice(True, "none", 25.0, 1, True)
    assert nccl.refusal(choice) is None
    assert "CPU-Reduce is not among this run's candidates" in TuneInputs.of(CommConfig(), 4, 2, "cuda",
                                                                            groups=True).refusal(choice)
    assert nccl.key(torch.nn.Linear(2, 2)) != TuneInputs.of(CommConfig(perf_mode="step"), 4, 2, "cuda", groups=True,
                                                             ).key(torch.nn.Linear(2, 2))


def test_cpu_reduce_against_a_flat_setting_is_named_with_what_to_change():
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": {"cpu_reduce": True, "hierarchical": False}})
    assert "comm.cpu_reduce: true is a form of the hierarchical algorithm, but comm.hierarchical is false" in str(e.value)
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": {"cpu_reduce": "yes"}})
    assert "comm.cpu_reduce must be one of" in str(e.value)
    assert CommConfig().cpu_reduce == "auto"
