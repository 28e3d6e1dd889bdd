"""CPU affinity: even split of the allowed cores across local ranks (run in subprocesses: it binds them)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiak.runtime.affinity import apply_cpu_affinity, even_split

REPO = Path(__file__).resolve().parents[2]


def test_even_split_covers_all_cores_without_overlap():
    cores = [0, 1, 2, 3, 4, 5, 6]
    shares = [even_split(cores, r, 3) for r in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    assert even_split([0, 1], 3, 4) == [1]  # fewer cores than ranks: shared round-robin
    with pytest.raises(ValueError, match="local_rank"):
        even_split(cores, 3, 3)


def test_disabled_does_nothing():
    before = os.sched_getaffinity(0)
    assert apply_cpu_affinity(False) == "cpu affinity: off"
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_each_local_rank_is_bound_to_its_share():
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, torch; from aiak.runtime.affinity import apply_cpu_affinity; d = apply_cpu_affinity(True); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads()); print(d)")
    seen = []
    for local_rank in range(2):
        env = {**os.environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                             check=True).stdout.splitlines()
        cores, threads = eval(out[0].rsplit(" ", 1)[0]), int(out[0].rsplit(" ", 1)[1])
        assert cores == even_split(allowed, local_rank, 2) and threads == len(cores)
        assert f"local rank {local_rank} bound to cores" in out[1]
        seen.append(set(cores))
    if len(allowed) >= 2:
        assert not seen[0] & seen[1]
