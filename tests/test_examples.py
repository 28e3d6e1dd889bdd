"""The examples run as shipped (CPU-small) and save a checkpoint that plain PyTorch can read."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("strategy", ["auto", "examples/my_profile.yaml"])
def test_train_cnn_example_runs(strategy):
    out = subprocess.run([sys.executable, "examples/train_cnn.py", "--strategy", strategy, "--samples", "256",
                          "--epochs", "1"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "epoch 0: loss" in out.stdout
    assert "aiak.optimize: strategy" in out.stderr  # the one-screen summary is logged
