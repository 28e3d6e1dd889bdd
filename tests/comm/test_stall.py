"""A collective that waits past ``comm.stall_warn_s`` names the ranks that have not reached it, then waits on."""
import re

import torch


def test_a_late_rank_is_named_by_the_ranks_waiting_for_it_and_the_run_finishes(launch_ranks):
    ranks = launch_ranks("stall", world=4, timeout=120)
    said = {rank: r[1.0]["warnings"] for rank, r in enumerate(ranks)}
    # rank 2 shares a node with rank 3: it waits in the intra-node reduce-scatter, and names rank 3 there
    [in_node] = [m for m in said[2] if "rank(s) [3]" in m]
    assert re.search(r"rank 2 has waited \d+ s in collective #\d+ \(step 2, bucket \d+, reduce-scatter in node", in_node)
    assert "rank 3: last at collective #" in in_node and "(step 1," in in_node and "still waiting" in in_node
    # ranks 0 and 1 wait across nodes, each for its partner there (rank 2, itself waiting; rank 3)
    assert any("rank(s) [2]" in m and "allreduce across nodes" in m for m in said[0])
    assert any("rank(s) [3]" in m and "allreduce across nodes" in m for m in said[1])
    assert said[3] == []                                     # the late rank waited for nobody
    for r in ranks:                                          # nothing said with the watch off (0) ...
        assert r[0.0]["warnings"] == []
    for r in ranks:                                          # ... and the same training either way, on every rank
        for a, b, c in zip(r[1.0]["params"], r[0.0]["params"], ranks[0][1.0]["params"]):
            assert torch.equal(a, b) and torch.equal(a, c)
