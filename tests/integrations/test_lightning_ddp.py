"""``AiakCallback`` under Lightning's DDP strategy (2 CPU processes on gloo). Lightning wraps the module in DDP before
``configure_optimizers``; aiak once wrapped it in a second DDP that Lightning never trained through, so its
communication settings (here fp16 compression) applied to nothing and accumulation switched off the
synchronisation of the unused wrapper. Now Lightning's DDP is the only one, with aiak's hook, and skips the
allreduce on accumulation micro-steps."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from tests.comm.conftest import free_port  # noqa: E402

SCRIPT = Path(__file__).with_name("lightning_ddp_script.py")
REPO = Path(__file__).resolve().parents[2]


def _fit(mode, tmp_path):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(SCRIPT), mode, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(tmp_path / f"{mode}-rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_the_callback_uses_lightnings_ddp_with_aiaks_hook_and_no_sync_on_micro_steps(tmp_path):
    aiak_ranks = _fit("aiak", tmp_path)
    lightning_ranks = _fit("lightning", tmp_path)
    for rank, result in enumerate(aiak_ranks):
        seen = result["seen"]
        assert all(s["ddps"] == 1 for s in seen), (rank, seen[:3])  # Lightning's DDP, no second one
        assert all(s["compression"] == "fp16" for s in seen), (rank, seen[:3])  # aiak's hook on it
        assert [s["sync"] for s in seen] == [i % 2 == 1 for i in range(len(seen))], (rank, seen)
        for k, v in result["weights"].items():
            assert torch.equal(v, aiak_ranks[0]["weights"][k]), (rank, k)  # the ranks agree
            # Lightning's own accumulation, fp32 allreduce: equal within the fp16 wire's rounding
            torch.testing.assert_close(v, lightning_ranks[rank]["weights"][k], rtol=2e-3, atol=2e-3)
