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
    # ranks 0 and 1 wait across nodes, each for its partner there: rank 3, and rank 2, which itself waits for rank 3
    # in its node. Both name rank 3, the late one (rank 0 named rank 2, which was only waiting)
    assert any("rank(s) [3]" in m and "allreduce across nodes" in m and "rank 2 waits in collective #" in m
               for m in said[0]), said[0]
    assert any("rank(s) [3]" in m and "allreduce across nodes" in m for m in said[1])
    assert not any("rank(s) [2]" in m for r in said.values() for m in r), said
    assert said[3] == []                                     # the late rank waited for nobody
    for r in ranks:                                          # nothing said with the watch off (0) ...
        assert r[0.0]["warnings"] == []
    for r in ranks:                                          # ... and the same training either way, on every rank
        for a, b, c in zip(r[1.0]["params"], r[0.0]["params"], ranks[0][1.0]["params"]):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_every_algorithm_names_exactly_the_late_rank(launch_ranks):
    ranks = launch_ranks("stall_algorithms", world=4, timeout=180)
    for name in ("local_sgd", "powersgd", "decentralized_all", "decentralized_shift"):
        said = {rank: r[name] for rank, r in enumerate(ranks)}
        assert said[3] == [], (name, said[3])                    # the late rank waited for nobody
        naming = [m for rank in (0, 1, 2) for m in said[rank] if "rank(s) [3]" in m]
        assert naming, (name, said)                              # a waiting rank names the late one
        assert all("for rank(s) [3]" in m for rank in (0, 1, 2) for m in said[rank]), (name, said)
        # each names the step it waits in: step 3 (counted from 0), which rank 3 reaches late; a rank already in
        # step 4's forward (decentralized SGD's exchange starts there) says 4. PowerSGD said "step 0" throughout,
        # local SGD's average after step 3 "step 4".
        steps = {int(re.search(r"\(step (\d+),", m).group(1)) for m in naming}
        assert 3 in steps and steps <= ({3, 4} if name.startswith("decentralized") else {3}), (name, naming)
