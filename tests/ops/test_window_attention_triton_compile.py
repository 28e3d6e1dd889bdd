"""Compile the window-attention kernels for a real CUDA target, without a GPU.

The interpreter (test_window_attention_triton.py) checks the numerics but not the compiler front end
(constexpr branches, layouts, dot shapes). Here the same kernels go through Triton's full NVIDIA
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for sm_90, on CPU.
"""
import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'aiak[triton]')")


def _compile(kernel, dtype, constexprs, num_warps):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn  # the autotuner wraps the JITFunction
    names = list(fn.arg_names)
    fp32_ptrs = {"Bias", "Lse", "DKAcc", "DVAcc", "DBias"}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "sm_scale":
            signature[name] = "fp32"
        elif name[0].isupper() and name not in ("N_CTX", "HEAD_DIM"):
            signature[name] = "*fp32" if name in fp32_ptrs else f"*{dtype}"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 1})
    except (RuntimeError, FileNotFoundError) as err:  # no NVIDIA toolchain bundled with this triton
        if "ptxas" in str(err) or "backend" in str(err).lower():
            pytest.skip(f"the NVIDIA toolchain of triton is unavailable here: {err}")
        raise


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype,block_n,block_m", [("fp16", 64, 64), ("bf16", 256, 32)],
                         ids=["n49-fp16-single-block", "n144-bf16-multi-block"])
def test_kernels_compile_for_sm90(dtype, block_n, block_m):
    from aiak.ops._triton.window_attention_kernels import _bwd_kernel, _fwd_kernel

    flags = {"HAS_BIAS": True, "HAS_MASK": True, "ALLOW_TF32": False, "BLOCK_N": block_n, "BLOCK_D": 32}
    fwd = _compile(_fwd_kernel, dtype, dict(flags, BLOCK_M=32), num_warps=4)
    bwd = _compile(_bwd_kernel, dtype, dict(flags, HAS_DBIAS=True, BLOCK_M=block_m, WINDOWS_PER_PROGRAM=8),
                   num_warps=8)
    for compiled in (fwd, bwd):
        assert compiled.asm["cubin"], "no cubin produced"
        assert ".entry" in compiled.asm["ptx"]
    # The backward keeps the bias-gradient reduction inside the kernel: one atomic add per query block.
    assert "atom" in bwd.asm["ptx"] or "red." in bwd.asm["ptx"]
