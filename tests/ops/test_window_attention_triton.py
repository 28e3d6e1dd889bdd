"""The Triton window-attention kernels, run for real by the Triton interpreter on CPU.

All cases run in one subprocess (tests/ops/triton_interpret_worker.py) with TRITON_INTERPRET=1, so the
flag never reaches the rest of the pytest session. Tolerance rule (as flash-attn tests its kernels):
|kernel - float64 ref| <= 2 * |same-dtype torch - float64 ref| + atol.

bf16: the interpreter multiplies bf16 bit patterns as integers inside tl.dot and truncates fp32 -> bf16
casts; the worker first repairs those two steps to the GPU's arithmetic (exact bf16 products, fp32
accumulation, round-to-nearest-even casts: tests/ops/triton_interpreter_bf16.py), and
test_interpreter_bf16_arithmetic_is_repaired checks the repair, so the bf16 cases hold the same rule.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    dict(id="n49-hf-strides-nomask-fp32", windows=4, heads=3, n=49, d=32, nw=0, dtype="fp32", bias=True,
         hf_layout=True),
    dict(id="n49-d32-mask-bf16", windows=4, heads=2, n=49, d=32, nw=2, dtype="bf16", bias=True),
    dict(id="n144-d16-mask-bf16-multiblock", windows=2, heads=1, n=144, d=16, nw=1, dtype="bf16", bias=True),
]
ATOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-3}
TORCH_DTYPE_NAMES = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(CASES)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    tagged = {tag: [json.loads(ln[len(tag) + 1:]) for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
              for tag in ("RESULTS", "INTERPRETER_BF16")}
    assert proc.returncode == 0 and all(tagged.values()), \
        f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = {r["id"]: r for r in tagged["RESULTS"][-1]}
    results["interpreter-bf16"] = tagged["INTERPRETER_BF16"][-1]
    return results


@pytest.mark.slow
def test_interpreter_bf16_arithmetic_is_repaired(interpreter_results):
    # After the repair a bf16 tl.dot equals torch's fp32 product of the same bf16 values (up to fp32
    # summation order) and fp32 -> bf16 casts round to nearest even, bit for bit, as on the GPU.
    probe = interpreter_results["interpreter-bf16"]
    assert probe["after"]["dot"] <= 1e-6 and probe["after"]["cast"] == 0, probe


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, id=c["id"]) for c in CASES])
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
    assert result["kernel_dtypes"]["out"] == TORCH_DTYPE_NAMES[case["dtype"]]
    if "dbias" in expected:
        assert result["kernel_dtypes"]["dbias"] == "torch.float32"
    assert result["out_token_major"]
