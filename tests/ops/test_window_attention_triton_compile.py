"""Compile the window-attention kernels for a real CUDA target, without a GPU.

The interpreter (test_window_attention_triton.py) checks the numerics but not the compiler front end
(constexpr branches, layouts, dot shapes). Here the same kernels go through Triton's full NVIDIA
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin) for sm_90, on CPU. The triton wheel (test extra) bundles
ptxas, so nothing is skipped: a compile error is a failure.
"""
import pytest
import torch
import triton

# Shared memory per block that a kernel may use on an H100 / H200 (sm_90: 227 KB).
SM90_MAX_SHARED_BYTES = 232448


def _compile(kernel, dtype, constexprs, num_warps):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn  # the autotuner wraps the JITFunction
    names = list(fn.arg_names)
    fp32_ptrs = {"AttnAdd", "Lse", "DKAcc", "DVAcc", "DBias"}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "sm_scale":
            signature[name] = "fp32"
        elif name[0].isupper():
            signature[name] = "*fp32" if name in fp32_ptrs else f"*{dtype}"
        else:
            signature[name] = "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype,n,block_n,block_m", [("fp16", 49, 64, 64), ("bf16", 144, 256, 32)],
                         ids=["n49-fp16-single-block", "n144-bf16-multi-block"])
def test_kernels_compile_for_sm90(dtype, n, block_n, block_m):
    from aiak.ops._triton.window_attention_kernels import _bwd_kernel, _fwd_kernel

    flags = {"ALLOW_TF32": False, "N_CTX": n, "HEAD_DIM": 32, "BLOCK_N": block_n, "BLOCK_D": 32}
    fwd = _compile(_fwd_kernel, dtype, dict(flags, BLOCK_M=32), num_warps=4)
    bwd = _compile(_bwd_kernel, dtype, dict(flags, HAS_DBIAS=True, BLOCK_M=block_m, WINDOWS_PER_PROGRAM=8),
                   num_warps=8)
    for compiled in (fwd, bwd):
        assert compiled.asm["cubin"], "no cubin produced"
        assert ".entry" in compiled.asm["ptx"]
    # The backward keeps the bias-gradient reduction inside the kernel: one atomic add per query block.
    assert "atom" in bwd.asm["ptx"] or "red." in bwd.asm["ptx"]


def _forward_configs_tried(dtype, n, d, allow_tf32):
    from aiak.ops._triton.window_attention import _block_sizes
    from aiak.ops._triton.window_attention_kernels import _fwd_kernel, _fwd_prune

    block_n, block_d = _block_sizes(n, d)
    q = torch.empty(1, 1, n, d, dtype=dtype)
    configs = _fwd_prune(_fwd_kernel.configs, {"N_CTX": n, "Q": q}, ALLOW_TF32=allow_tf32, BLOCK_N=block_n,
                         BLOCK_D=block_d)
    return [(c.kwargs["BLOCK_M"], c.num_warps) for c in configs]


def test_fp32_fma_forward_at_the_largest_tiles_tries_only_its_smallest_query_block(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter tries one config anyway
    assert _forward_configs_tried(torch.float32, 256, 128, allow_tf32=False) == [(16, 2)]
    every = _forward_configs_tried(torch.float32, 256, 128, allow_tf32=True)
    assert len(every) == 5 and _forward_configs_tried(torch.float16, 256, 128, allow_tf32=False) == every
    assert _forward_configs_tried(torch.float32, 49, 32, allow_tf32=False) == [c for c in every if c[0] <= 64]
    assert _forward_configs_tried(torch.float32, 256, 64, allow_tf32=False) == every


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_fp32_fma_forward_at_the_largest_tiles_does_not_fit_sm90_shared_memory():
    # Why the prune above is sound: even the smallest query block of the fp32 FMA forward at N=256, D=128
    # needs more shared memory than an H100/H200 has, so its launch raises OutOfResources and
    # window_attention falls back (test_window_attention_fallback.py). About a minute of ptxas on 2 cores.
    from aiak.ops._triton.window_attention_kernels import _fwd_kernel

    flags = {"ALLOW_TF32": False, "N_CTX": 256, "HEAD_DIM": 128, "BLOCK_N": 256, "BLOCK_D": 128}
    compiled = _compile(_fwd_kernel, "fp32", dict(flags, BLOCK_M=16), num_warps=2)
    assert compiled.metadata.shared > SM90_MAX_SHARED_BYTES, compiled.metadata.shared
