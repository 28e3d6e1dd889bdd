"""The Triton window-attention kernels, run for real by the Triton interpreter on CPU.

All cases run in one subprocess (tests/ops/triton_interpret_worker.py) with TRITON_INTERPRET=1, so the
flag never reaches the rest of the pytest session. Tolerance rule (flash-attn, ../shared/STYLE.md):
|kernel - float64 ref| <= 2 * |same-dtype torch - float64 ref| + atol.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'aiak[triton]')")

WORKER = Path(__file__).with_name("triton_interpret_worker.py")
REPO = Path(__file__).resolve().parents[2]

# (id, windows, heads, N, D, nW (0 = no mask), dtype, bias, extra)
CASES = [
    dict(id="n49-d32-mask-fp32", windows=4, heads=2, n=49, d=32, nw=2, dtype="fp32", bias=True),
    dict(id="n49-d32-mask-fp16", windows=4, heads=2, n=49, d=32, nw=2, dtype="fp16", bias=True),
    dict(id="n64-d64-nomask-fp32", windows=3, heads=2, n=64, d=64, nw=0, dtype="fp32", bias=True),
    dict(id="n144-d32-mask-fp32-multiblock", windows=2, heads=1, n=144, d=32, nw=2, dtype="fp32", bias=True),
    dict(id="n144-d16-mask-fp16-multiblock", windows=2, heads=1, n=144, d=16, nw=1, dtype="fp16", bias=True),
    dict(id="n20-d24-nonpow2-nW4-fp32", windows=8, heads=3, n=20, d=24, nw=4, dtype="fp32", bias=True),
    dict(id="n16-d16-plain-fp32", windows=2, heads=2, n=16, d=16, nw=0, dtype="fp32", bias=False),
    dict(id="n49-mask-only-fp32", windows=4, heads=2, n=49, d=32, nw=4, dtype="fp32", bias=False),
    dict(id="n49-frozen-bias-fp32", windows=2, heads=2, n=49, d=32, nw=2, dtype="fp32", bias=True, bias_grad=False),
    dict(id="n49-hf-strides-fp32", windows=4, heads=2, n=49, d=32, nw=2, dtype="fp32", bias=True, hf_layout=True),
]
ATOL = {"fp32": 1e-5, "fp16": 1e-3}


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(CASES)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {r["id"]: r for r in json.loads(lines[-1][len("RESULTS "):])}


BF16_SKIP = pytest.mark.skip(
    reason="the Triton 3.9 interpreter computes tl.dot on bf16 operands wrongly (numpy has no bf16); "
           "bf16 is checked on GPU by benchmarks/window_attention.py gpu_checks()")
PARAMS = [pytest.param(c, id=c["id"]) for c in CASES] + [
    pytest.param(dict(id="n49-d32-mask-bf16", dtype="bf16"), id="n49-d32-mask-bf16", marks=BF16_SKIP)]


@pytest.mark.slow
@pytest.mark.parametrize("case", PARAMS)
def test_triton_kernel_matches_float64_reference(interpreter_results, case):
    result = interpreter_results[case["id"]]
    assert "error" not in result, result.get("error")
    expected = ["out", "dq", "dk", "dv"] + (["dbias"] if case["bias"] and case.get("bias_grad", True) else [])
    assert sorted(result["kernel_err"]) == sorted(expected)
    for name in expected:
        kernel, baseline = result["kernel_err"][name], result["torch_err"][name]
        bound = 2 * baseline + ATOL[case["dtype"]] * max(1.0, result["ref_scale"][name])
        assert kernel <= bound, f"{name}: kernel error {kernel:.3g} > {bound:.3g} (same-dtype torch {baseline:.3g})"
    # Gradients come back in the dtype of their inputs (bias is an fp32 parameter).
    assert result["kernel_dtypes"]["out"] == {"fp32": "torch.float32", "fp16": "torch.float16"}[case["dtype"]]
    if "dbias" in expected:
        assert result["kernel_dtypes"]["dbias"] == "torch.float32"
    assert result["out_token_major"]


@pytest.mark.slow
def test_interpreter_cases_stay_small(interpreter_results):
    total = sum(r.get("seconds", 0.0) for r in interpreter_results.values())
    assert total < 60, f"interpreter cases took {total:.1f}s; keep the shapes small"
