"""LAMB's and LARS's Triton kernels (`aiak.optim._triton.layerwise`): run for real by the Triton interpreter on CPU
against the float64 transcriptions of the papers (test_lamb.py, test_lars.py), at the tolerance the torch paths
meet; compiled for sm_90 by Triton's NVIDIA pipeline on CPU, every kernel in registers (ptxas: no spill); and where
they cannot run, `fused=True` says so once and the torch path steps.

The interpreter runs in one subprocess (triton_layerwise_worker.py), so its flag never reaches the rest of the
pytest session.
"""
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))   # the problems of the LAMB and LARS tests beside this file
import test_lamb  # noqa: E402
import test_lars  # noqa: E402
from aiak.optim import Lamb, Lars  # noqa: E402
from aiak.optim._multi_tensor import triton_unfit  # noqa: E402

WORKER = Path(__file__).with_name("triton_layerwise_worker.py")
REPO = Path(__file__).resolve().parents[2]
MODULES = {"lamb": test_lamb, "lars": test_lars}
MASKS = {"all": lambda m: m.ALL_ADAPT, "mixed": lambda m: m.MIXED}

CASES = ([dict(id=f"lamb-{c}-{mask}", optimizer="lamb", config=c, mask=mask)
          for c in test_lamb.CONFIGS for mask in MASKS]
         + [dict(id=f"lars-{c}-{mask}", optimizer="lars", config=c, mask=mask)
            for c in test_lars.CONFIGS for mask in MASKS]
         + [dict(id=f"{o}-decay-mixed-bf16", optimizer=o, config="decay", mask="mixed", dtype="bf16", steps=5)
            for o in MODULES]
         # fp32 and bf16 parameters in one group: a launch per dtype, their norms scattered into the group's
         + [dict(id=f"{o}-decay-fp32-and-bf16", optimizer=o, config="decay", mask="all", dtype="fp32+bf16", steps=5)
            for o in MODULES]
         # a tensor of 300,000 elements: 293 programs, so the partial sums take three iterations of the sum's loop
         + [dict(id=f"{o}-large", optimizer=o, config=c, mask="all", large=True, steps=3)
            for o, c in (("lamb", "clip-trust-and-grad"), ("lars", "nesterov"))])
LARGE_SHAPES = [(600, 500), (40,), (257, 130)]
LARGE_ZERO = 1


def problem(case):
    """``(params64, grads, adapt mask, index of the parameter that starts at 0)``."""
    module = MODULES[case["optimizer"]]
    mask = MASKS[case["mask"]](module)
    if not case.get("large"):
        return (*module.make_problem(), mask, module.ZERO_PARAM)
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in LARGE_SHAPES]
    params[LARGE_ZERO].zero_()
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) * (0.1 + i) for i, s in enumerate(LARGE_SHAPES)]
             for _ in range(case["steps"])]
    return params, grads, [True] * len(LARGE_SHAPES), LARGE_ZERO


def train(case, **options):
    """The case's optimizer over its problem; returns the parameters it reached."""
    module = MODULES[case["optimizer"]]
    params64, grads, mask, _ = problem(case)
    steps = case.get("steps", module.STEPS)
    if case.get("dtype") == "fp32+bf16":   # every other parameter bf16, all in one group
        params = [torch.nn.Parameter(p.to(torch.bfloat16 if i % 2 else torch.float32)) for i, p in enumerate(params64)]
        opt = (Lamb if case["optimizer"] == "lamb" else Lars)(params, **module.CONFIGS[case["config"]], **options)
        for step_grads in grads[:steps]:
            for p, g in zip(params, step_grads):
                p.grad = g.to(p.dtype)
            opt.step()
        return params
    run = module.run_lamb if case["optimizer"] == "lamb" else module.run_lars
    dtype = {"bf16": torch.bfloat16}.get(case.get("dtype"), torch.float32)
    params, _ = run(params64, grads, mask, dtype=dtype, steps=steps, **module.CONFIGS[case["config"]], **options)
    return params


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return torch.load(out)


FP32 = [c for c in CASES if c.get("dtype") is None]


@pytest.mark.slow
@pytest.mark.parametrize("case", FP32, ids=[c["id"] for c in FP32])
def test_the_kernels_match_the_float64_reference(case, interpreted, assert_matches_reference):
    """Every element within 1e-5 relative of the paper's float64 step, as the torch paths (conftest), through the
    Triton passes only (not one call of a torch path)."""
    result = interpreted[case["id"]]
    assert result["triton"] > 0 and result["torch"] == 0, result
    module = MODULES[case["optimizer"]]
    params64, grads, mask, zero = problem(case)
    steps = case.get("steps", module.STEPS)
    reference = module.reference_lamb if case["optimizer"] == "lamb" else module.reference_lars
    expected = reference(params64, grads[:steps], mask, **module.CONFIGS[case["config"]])
    assert_matches_reference(result["params"], expected, params64, zero)


BF16 = [c for c in CASES if c.get("dtype") in ("bf16", "fp32+bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16, ids=[c["id"] for c in BF16])
def test_bf16_parameters_step_in_fp32_as_the_torch_path(case, interpreted):
    """bf16 weights, fp32 maths: within one bf16 rounding (2^-8 relative) of the torch path's bf16 weights after five
    steps (each rounds its fp32 result once a step; the two results may differ in the last fp32 bit); beside fp32
    weights in one group, those within 1e-5 of the torch path's."""
    result = interpreted[case["id"]]
    assert result["triton"] > 0 and result["torch"] == 0, result
    torch_path = train(case, fused=False)
    for got, want in zip(result["params"], torch_path):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8 if got.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-6)


def _kernels():
    """Each kernel with the constexprs of a launch, for the compile test."""
    import triton.language as tl

    from aiak.optim._triton import layerwise_kernels as k
    return [(k._lamb_moments_kernel, dict(PARAM=tl.bfloat16, ADAPT=True, BLOCK=1024)),
            (k._lamb_moments_kernel, dict(PARAM=tl.float32, ADAPT=False, BLOCK=1024)),
            (k._lamb_update_kernel, dict(PARAM=tl.float32, BLOCK=1024)),
            (k._lars_squares_kernel, dict(PARAM=tl.float16, BLOCK=1024)),
            (k._lars_update_kernel, dict(PARAM=tl.float32, MOMENTUM=True, NESTEROV=True, ADAPT=True, BLOCK=1024)),
            (k._lars_update_kernel, dict(PARAM=tl.bfloat16, MOMENTUM=False, NESTEROV=False, ADAPT=False,
                                         BLOCK=1024)),
            (k._sum_partials_kernel, dict(RBLOCK=128))]


POINTER_TYPES = {"BLOCK_TENSOR": "*i32", "PARTIALS": "*fp32", "SQUARES": "*fp32", "RATIOS": "*fp32"}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_the_kernels_compile_for_sm90_in_registers(tmp_path):
    """Triton's full NVIDIA pipeline for sm_90 on this CPU (the wheel bundles ptxas), then ptxas -v on the PTX: each
    kernel compiles, and none spills to local memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    ptxas = get_ptxas(90).path
    for kernel, constexprs in _kernels():
        names = list(kernel.arg_names)
        signature = {n: "constexpr" if n in constexprs else POINTER_TYPES.get(n, "*i64") if n.isupper() else "fp32"
                     for n in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(n),): v for n, v in constexprs.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm["cubin"] and ".entry" in compiled.asm["ptx"]
        ptx = tmp_path / f"{kernel.fn.__name__}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "out.cubin")],
                              capture_output=True, text=True, timeout=300)
        assert info.returncode == 0, info.stderr
        registers = re.search(r"Used (\d+) registers", info.stderr)
        spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", info.stderr)
        assert registers and spills and all(int(s) == 0 for s in spills), (kernel.fn.__name__, info.stderr)


@pytest.mark.parametrize("optimizer", [Lamb, Lars])
def test_fused_where_the_kernels_cannot_run_says_so_once_and_steps_the_torch_path(optimizer, monkeypatch):
    """CPU parameters without the interpreter: ``fused=True`` warns once, naming why and what to use, and steps exactly
    as ``fused=False``; the default chooses the torch path here without a word."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    results = {}
    for fused in (True, False, None):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
        opt = optimizer(params, lr=0.1, fused=fused)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
        said = [str(w.message) for w in caught if "fused=True" in str(w.message)]
        assert len(said) == (1 if fused else 0), said
        if fused:
            assert "on cpu" in said[0] and "fused=None" in said[0]
        results[fused] = [p.detach().clone() for p in params]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))
    assert all(torch.equal(a, b) for a, b in zip(results[None], results[False]))


def test_what_the_kernels_cannot_step_is_named(monkeypatch):
    """`triton_unfit` names each reason: a device, a dtype, a gradient in another layout than its parameter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # CPU tensors count as the kernels' device here
    w = torch.randn(2, 3, 4, 4)
    assert triton_unfit([w], [torch.randn(2, 3, 4, 4)]) == ""
    assert "laid out" in triton_unfit([w.contiguous(memory_format=torch.channels_last)], [torch.randn(2, 3, 4, 4)])
    assert "fp32, fp16 and bf16" in triton_unfit([w.double()], [w.double()])
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "on cpu" in triton_unfit([w], [w])
