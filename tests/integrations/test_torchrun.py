"""torchrun with 2 gloo ranks (issue 14, item 3): one summary and each aiak warning once, from rank 0; a loader
without a ``DistributedSampler`` is named in one warning."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("torchrun_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _torchrun(tmp_path, mode):
    out = tmp_path / mode
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(out), mode]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after 120 s\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, done.stdout + done.stderr


def test_two_ranks_one_summary_and_the_unsharded_loader_warning_once_on_rank_0(tmp_path):
    ranks, output = _torchrun(tmp_path, "unsharded")
    assert output.count("aiak.optimize: strategy") == 1 and "[rank 0] aiak: aiak.optimize: strategy" in output
    rank0, rank1 = ranks
    unsharded = [w for w in rank0["warnings"] if "DistributedSampler" in w]
    assert len(unsharded) == 1 and "each of the 2 ranks iterates the whole dataset" in unsharded[0]
    assert rank1["warnings"] == []
    assert rank0["weights"] == rank1["weights"]  # DDP kept the ranks identical


def test_a_distributed_sampler_gets_no_warning(tmp_path):
    ranks, output = _torchrun(tmp_path, "sharded")
    assert all(not any("DistributedSampler" in w for w in r["warnings"]) for r in ranks)
    assert output.count("aiak.optimize: strategy") == 1
