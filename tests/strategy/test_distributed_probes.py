"""The distribution probes on real gloo ranks: world size, ranks per node, nodes and backend, as the topology
module finds them (torchrun's environment), and the ``nodes:`` rule that follows from them."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_probe_worker.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, nodes, timeout: float = 90.0):
    """One process per entry of ``nodes`` (the node of each rank), env as torchrun sets it; every process is
    killed when the timeout passes, so a hang fails the test instead of blocking the suite."""
    world, port, procs = len(nodes), free_port(), []
    for rank, node in enumerate(nodes):
        peers = [r for r in range(world) if nodes[r] == node]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(peers.index(rank)), "LOCAL_WORLD_SIZE": str(len(peers)),
               "GROUP_RANK": str(node), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / f"rank{rank}.json")], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    try:
        for rank, (p, _) in enumerate(procs):
            try:
                if p.wait(timeout=timeout) != 0:
                    failed.append(rank)
            except subprocess.TimeoutExpired:
                failed.append(rank)
                break
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            log.close()
    if failed:
        logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        pytest.fail(f"rank(s) {failed} failed or timed out after {timeout}s\n{logs}")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_are_probed_and_match_multi_node_on_every_rank(tmp_path):
    results = launch(tmp_path, nodes=[0, 1])
    for r in results:
        assert (r["world_size"], r["local_size"], r["nodes"], r["backend"]) == (2, 1, 2, "gloo")
        assert "multi_node_comm" in r["matched"] and r["strategy"]["comm"]["autotune"] is True
        assert r["strategy"]["grad_accumulation"] == 1   # accumulation changes the training: never from auto
    assert results[0]["strategy"] == results[1]["strategy"] and results[0]["digest"] == results[1]["digest"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ranks_on_one_node_are_one_node(tmp_path):
    results = launch(tmp_path, nodes=[0, 0])
    for r in results:
        assert (r["world_size"], r["local_size"], r["nodes"], r["backend"]) == (2, 2, 1, "gloo")
        assert "multi_node_comm" not in r["matched"]
    assert results[0]["strategy"] == results[1]["strategy"]
