"""Triton kernels that cannot launch (``OutOfResources``) fall back to the torch path, once per shape.

On a GPU the fp32 N=256 D=128 kernels can need more shared memory than the device has, and Triton raises
``triton.runtime.errors.OutOfResources`` at launch, for every autotune config. A CPU has no shared memory
to exhaust (the interpreter runs any tile), so tests/ops/triton_out_of_resources_worker.py makes the
kernel launch raise that real exception class, where a GPU raises it, under TRITON_INTERPRET=1 in a
subprocess (the flag must not reach this pytest process). The GPU row for the same shape is in
benchmarks/window_attention.py gpu_checks().
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("triton_out_of_resources_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scenarios():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def _calls(scenarios, name):
    result = scenarios[name]
    assert "error" not in result, result
    return result


def _launches(call):
    return call["forward_launches"], call["backward_launches"]


@pytest.mark.slow
def test_forward_that_cannot_launch_runs_the_torch_path_and_is_not_tried_again(scenarios):
    first, second, inference = _calls(scenarios, "forward_cannot_launch")
    # The fallback computes exactly the torch path: same output and same gradients, bit for bit.
    for call in (first, second, inference):
        assert all(diff == 0.0 for diff in call["diff_vs_torch"].values()), call
    assert _launches(first) == (1, 0)  # tried once; the backward was the torch path's own
    assert _launches(second) == (0, 0) and _launches(inference) == (0, 0)  # remembered: straight to torch
    assert len(first["warnings"]) == 1 and not second["warnings"] and not inference["warnings"]
    warning = first["warnings"][0]
    for said in ("Triton forward kernel cannot launch", "float32 N=256 D=128 (bias, mask)", "BLOCK_M=16",
                 "out of resource: shared memory", "torch (SDPA) path", "results are unchanged"):
        assert said in warning, warning


@pytest.mark.slow
def test_backward_that_cannot_launch_recomputes_the_gradients_through_torch(scenarios):
    first, second, inference = _calls(scenarios, "backward_cannot_launch")
    assert _launches(first) == (1, 1)
    # The Triton forward ran (kernel vs SDPA rounding only); the gradients are the torch path's, bit for bit.
    assert 0.0 < first["diff_vs_torch"]["out"] <= 1e-5 and first["diff_vs_torch"]["grads"] == 0.0, first
    assert _launches(second) == (0, 0) and all(diff == 0.0 for diff in second["diff_vs_torch"].values()), second
    # Only training is sent to torch: inference still runs the forward kernel, which fits.
    assert _launches(inference) == (1, 0) and inference["diff_vs_torch"]["out"] <= 1e-5, inference
    assert len(first["warnings"]) == 1 and not second["warnings"] and not inference["warnings"]
    assert "Triton backward kernel cannot launch" in first["warnings"][0]
    assert "inference keeps the Triton forward" in first["warnings"][0]


@pytest.mark.slow
def test_other_launch_errors_are_raised_not_taken_for_a_resource_limit(scenarios):
    result = _calls(scenarios, "other_launch_error")
    assert result["raised"] == "an unrelated launch failure" and not result["warnings"]
    assert result["launches_after"] == 1 and result["diff_vs_torch"] <= 1e-5  # the shape was not given up
