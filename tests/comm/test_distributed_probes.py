"""The distribution probes on real gloo ranks: world size, ranks per node, nodes and backend, as the topology
module finds them (torchrun's environment), and the ``nodes:`` rule that follows from them."""


def test_two_nodes_are_probed_and_match_multi_node_comm_on_every_rank(launch_ranks):
    results = launch_ranks("probe", world=2, nodes=[0, 1])
    for r in results:
        assert (r["world_size"], r["local_size"], r["nodes"], r["backend"]) == (2, 1, 2, "gloo")
        assert "multi_node_comm" in r["matched"] and r["strategy"]["comm"]["autotune"] is True
        assert r["strategy"]["grad_accumulation"] == 1   # accumulation changes the training: never from auto
    assert results[0]["strategy"] == results[1]["strategy"] and results[0]["digest"] == results[1]["digest"]


def test_ranks_on_one_node_are_one_node(launch_ranks):
    results = launch_ranks("probe", world=2, nodes=[0, 0])
    for r in results:
        assert (r["world_size"], r["local_size"], r["nodes"], r["backend"]) == (2, 2, 1, "gloo")
        assert "multi_node_comm" not in r["matched"]
    assert results[0]["strategy"] == results[1]["strategy"]
