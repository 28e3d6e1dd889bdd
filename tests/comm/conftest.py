"""Launch N ranks as ``torchrun`` would (gloo on 127.0.0.1), each running a scenario of dist_worker.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("dist_worker.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, tmp_path: Path, world: int = 4, nodes=None, timeout: float = 90.0, env=None,
           allow_fail: bool = False, worker: Path = WORKER):
    """Run ``scenario`` of ``worker`` (default dist_worker.py) on ``world`` ranks; ``nodes`` lists the node of each
    rank (default 2 nodes x 2).

    Returns the per-rank result objects (``torch.save``d by the worker). Every process is killed when the
    timeout passes, so a hang fails the test instead of blocking the suite.
    """
    nodes = nodes if nodes is not None else [r // 2 for r in range(world)]
    port = free_port()
    out = tmp_path / f"out-{scenario}-{port}"
    out.mkdir()
    procs = []
    for rank in range(world):
        node = nodes[rank]
        local_ranks = [r for r in range(world) if nodes[r] == node]
        e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
             "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_ranks.index(rank)),
             "LOCAL_WORLD_SIZE": str(len(local_ranks)), "GROUP_RANK": str(node), "NODE_RANK": str(node),
             "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        e.update(env or {})
        e = {k: v for k, v in e.items() if v is not None}
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(worker), scenario, str(out)], env=e, stdout=log,
                                       stderr=subprocess.STDOUT), log))
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
    logs = "\n".join(f"--- rank {r} ---\n{(out / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
    if failed and not allow_fail:
        pytest.fail(f"{scenario}: rank(s) {failed} failed or timed out after {timeout}s\n{logs}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) if (out / f"rank{r}.pt").exists() else None
            for r in range(world)]


@pytest.fixture(scope="session")
def launch_ranks(tmp_path_factory):
    """``launch_ranks(scenario, world=4, nodes=None, timeout=90, env=None, worker=WORKER)`` -> per-rank results."""
    return lambda scenario, **kw: launch(scenario, tmp_path_factory.mktemp(scenario), **kw)
