"""Topology detection and the flat fallback for uneven nodes."""
import pytest
from torch.testing import assert_close

from aiak.comm.allreduce.topology import Topology


def test_topology_properties():
    t = Topology(rank=3, world_size=4, nodes=((0, 1), (2, 3)), source="env")
    assert (t.node_rank, t.local_rank, t.local_size, t.num_nodes) == (1, 1, 2, 2)
    assert t.uniform and t.hierarchical_useful
    assert not Topology(0, 3, ((0, 1), (2,)), "env").uniform
    assert not Topology(0, 2, ((0, 1),), "env").hierarchical_useful  # one node: nothing to gain
    assert not Topology(0, 2, ((0,), (1,)), "env").hierarchical_useful  # one rank per node: same as flat


@pytest.mark.slow
def test_uneven_nodes_fall_back_to_flat_and_hostnames_group_a_single_host(launch_ranks):
    results = launch_ranks("uneven", world=3, nodes=[0, 0, 1], timeout=90)
    for rank, r in enumerate(results):
        assert r["topology"].nodes == ((0, 1), (2,)) and r["topology"].source == "env"
        assert r["state"] == "flat+fp16"
        # said once, by rank 0 (issue 14: the other ranks decide the same and stay quiet)
        assert any("using flat allreduce" in w for w in r["warnings"]) == (rank == 0)
        got, expected = r["grads"]
        for a, b in zip(got, expected):
            assert_close(a, b, rtol=0, atol=2e-3 * float(b.abs().max()))
        assert r["hostname_topology"].nodes == ((0, 1, 2),)
        assert r["hostname_topology"].source == "hostname"
