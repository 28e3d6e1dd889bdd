"""Several TCP connections per peer across nodes (``comm.connections``): the same sums, sent in pieces at once."""
import pytest
import torch

from aiak.comm.config import CommConfig
from aiak.comm.allreduce.connections import AUTO_CANDIDATES, connection_counts
from aiak.strategy.schema import Strategy, StrategyError



@pytest.fixture(scope="module")
def ranks(launch_ranks):
    return launch_ranks("connections", world=4, timeout=150)


def _cross_node_allreduces(calls, hierarchical):
    inter = {(0, 2), (1, 3)}
    return [c for c in calls if c[0] in ("all_reduce", "all_to_all", "all_gather")
            and (c[1] in inter if hierarchical else c[1] == (0, 1, 2, 3))]


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_four_connections_give_bit_identical_sums_on_integer_values(ranks, hierarchical, compression):
    expected = sum(torch.randint(-8, 9, (100_003,), generator=torch.Generator().manual_seed(r)).float()
                   for r in range(4))   # the exact average of rank r's values x 4 / 4
    for r in ranks:
        one, four = r[(hierarchical, compression, 1)], r[(hierarchical, compression, 4)]
        assert torch.equal(one["result"], expected) and torch.equal(four["result"], one["result"])
        assert four["describe"].endswith("4 connections") and "connections" not in one["describe"]
        # the stage that crosses nodes is sent as 4 pieces per collective, each a quarter; nothing else changes
        crossing1, crossing4 = (_cross_node_allreduces(x["calls"], hierarchical) for x in (one, four))
        assert len(crossing4) == 4 * len(crossing1) > 0
        assert sum(c[2] for c in crossing4) == sum(c[2] for c in crossing1)
        rest1, rest4 = ([c for c in x["calls"] if c not in cs] for x, cs in ((one, crossing1), (four, crossing4)))
        assert rest1 == rest4


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_int8_over_four_connections_agrees_on_every_rank_within_its_quantization(ranks, hierarchical):
    expected = sum(torch.randint(-8, 9, (100_003,), generator=torch.Generator().manual_seed(r)).float()
                   for r in range(4))
    results = [r[(hierarchical, "int8", 4)]["result"] for r in ranks]
    assert all(torch.equal(x, results[0]) for x in results)
    # int8 with a min/scale per 2048 values over a range of 8 per rank: two quantizations of at most range/255/2
    assert (results[0] - expected).abs().max() <= 2 * (64 / 255)


def test_the_groups_are_created_once_per_layout(ranks):
    assert all(r["same_groups"] for r in ranks)


def test_the_setting_chooses_what_is_set_up():
    assert connection_counts(4, autotune=False, crosses_nodes=True, available=True) == (4,)
    assert connection_counts("auto", autotune=True, crosses_nodes=True, available=True) == AUTO_CANDIDATES
    assert connection_counts("auto", autotune=False, crosses_nodes=True, available=True) == (1,)
    assert connection_counts(4, autotune=True, crosses_nodes=False, available=True) == (1,)   # one node
    assert connection_counts(4, autotune=True, crosses_nodes=True, available=False) == (1,)   # NCCL


def test_a_bad_setting_is_named_with_what_is_valid():
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": {"connections": 0}})
    assert "comm.connections must be 'auto' or an integer >= 1, got 0" in str(e.value)
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": {"connections": "many"}})
    assert "comm.connections must be one of ['auto', 'an integer >= 1'], got 'many'" in str(e.value)
    assert CommConfig().connections == "auto"


def test_the_link_a_measurement_was_made_on_names_the_nodes_and_the_interfaces(monkeypatch):
    from aiak.comm.allreduce.topology import Topology

    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    topology = Topology(rank=0, world_size=4, nodes=((0, 1), (2, 3)), source="env", hosts=("node-a", "node-b"))
    assert topology.link == "node-a,node-b;GLOO_SOCKET_IFNAME=eth1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth2")      # another network between the same hosts: another link
    assert topology.link != "node-a,node-b;GLOO_SOCKET_IFNAME=eth1"


def test_a_negative_stall_warning_is_named_with_what_is_valid():
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": {"stall_warn_s": -1}})
    assert "comm.stall_warn_s must be >= 0, got -1" in str(e.value)
