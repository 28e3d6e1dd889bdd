"""Launchers for the window-attention Triton kernels: check inputs, allocate outputs, pick the grid.

Imported only when the Triton backend runs (a CUDA call, or a test under ``TRITON_INTERPRET=1``).

Both launchers raise triton's ``OutOfResources`` (re-exported here) when no autotune config fits the
device (e.g. shared memory at fp32, N=256, D=128): Triton 3.8's autotuner scores a config whose launch
raises it as infinitely slow (``Autotuner._bench``), keeps the first config when all of them do, and the
launch that follows raises it again (``CompiledKernel._init_handles``). The dispatcher catches it.
"""
from __future__ import annotations

import torch
import triton
from triton.runtime.errors import OutOfResources

from aiak.ops._triton.window_attention_kernels import _bwd_kernel, _fwd_kernel

__all__ = ["window_attention_forward", "window_attention_backward", "OutOfResources"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _block_sizes(n: int, d: int):
    # tl.dot needs every dimension >= 16.
    return max(16, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(d))


def _allow_tf32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32


def _token_major(windows, heads, n, d, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A [B*nW, H, N, D] tensor laid out as [B*nW, N, H, D]: every Swin module follows the attention with
    ``out.transpose(1, 2).reshape(B*nW, N, C)``, which is then free (no copy)."""
    return torch.empty((windows, n, heads, d), device=like.device, dtype=dtype or like.dtype).transpose(1, 2)


def _launch(kernel, grid, *args, **meta) -> None:
    """Launch an autotuned kernel. An ``OutOfResources`` from it gets ``tried_configs``: the configs that
    the autotuner tried (after the kernel's own pruning), for the fallback's warning."""
    try:
        kernel[grid](*args, **meta)
    except OutOfResources as err:
        tried = kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, args)), **meta)
        err.tried_configs = "; ".join(" ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" warps={c.num_warps}"
                                      for c in tried)
        raise


def _dummy(ref: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, device=ref.device, dtype=torch.float32)


def additive_tile(bias, mask, heads: int, n: int, block_n: int, device) -> torch.Tensor:
    """``bias + mask`` as one fp32 ``[G, H, block_n, block_n]`` tensor (G = nW with a mask, else 1) that the
    kernels read tile by tile: padded columns hold -inf (no attention to padding), padded rows 0 in the real
    columns (no NaN from a row of -inf; their results are never stored). Built once per forward and kept for
    the backward.

    The result is contiguous whatever the layout of ``bias``: Hugging Face and timm build the bias as
    ``table[index].view(N, N, H).permute(2, 0, 1)`` (H innermost), and a sum or pad of it would keep that
    layout, which the kernels would read as if contiguous."""
    groups = 1 if mask is None else mask.shape[0]
    add = torch.full((groups, heads, block_n, block_n), float("-inf"), device=device, dtype=torch.float32)
    inner = add[:, :, :n, :n]  # written in place: one kernel per part, whatever the inputs' layouts
    if mask is not None and bias is not None:
        torch.add(mask.unsqueeze(1), bias.unsqueeze(0), out=inner)  # fp32 out: the sum is taken in fp32
    elif mask is not None or bias is not None:
        inner.copy_(mask.unsqueeze(1) if mask is not None else bias.unsqueeze(0))
    else:
        inner.zero_()
    if block_n > n:
        add[:, :, n:, :n] = 0.0
    return add


def _check(q, k, v, bias, mask):
    assert q.dim() == 4 and q.shape == k.shape == v.shape, "q, k, v must be [B*nW, H, N, D] of one shape"
    assert q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype, f"q/k/v dtype must be one of {_DTYPES}"
    assert q.device == k.device == v.device
    windows, heads, n, _ = q.shape
    if bias is not None:
        assert tuple(bias.shape) == (heads, n, n) and bias.device == q.device
    if mask is not None:
        assert mask.dim() == 3 and tuple(mask.shape[1:]) == (n, n) and windows % mask.shape[0] == 0
        assert mask.device == q.device


def window_attention_forward(q, k, v, bias, mask, scale):
    """Returns (out [B*nW, H, N, D] in q's dtype, token-major (see _token_major), lse [B*nW, H, N] fp32,
    the additive tile for the backward)."""
    _check(q, k, v, bias, mask)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    windows, heads, n, d = q.shape
    block_n, block_d = _block_sizes(n, d)
    attn_add = additive_tile(bias, mask, heads, n, block_n, q.device)
    out = _token_major(windows, heads, n, d, q)
    lse = torch.empty((windows, heads, n), device=q.device, dtype=torch.float32)

    def grid(meta):
        return (windows * heads, triton.cdiv(n, meta["BLOCK_M"]))

    _launch(
        _fwd_kernel, grid,
        q, k, v, attn_add, out, lse,
        scale, heads, attn_add.shape[0],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n, d,
        ALLOW_TF32=_allow_tf32(q.dtype),
        BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return out, lse, attn_add


def _bwd_block_m(block_n: int) -> int:
    # Whole window in one query block up to 64 rows; beyond that 32-row blocks keep the
    # [BLOCK_M, BLOCK_N] fp32 tiles (scores, P, dP, dS) within registers.
    return block_n if block_n <= 64 else 32


def window_attention_backward(grad_out, q, k, v, bias, mask, out, lse, attn_add, scale, need_bias_grad):
    """Returns (dq, dk, dv, dbias or None); dbias is summed over windows, in bias's dtype.

    dq, dk, dv share the forward output's token-major layout (``out`` as returned by the forward);
    ``attn_add`` is the forward's additive tile."""
    _check(q, k, v, bias, mask)
    q, k, v, grad_out = (_unit_last_stride(t) for t in (q, k, v, grad_out))
    assert out.shape == grad_out.shape == q.shape and out.stride(-1) == 1
    windows, heads, n, d = q.shape
    block_n, block_d = _block_sizes(n, d)
    block_m = _bwd_block_m(block_n)
    single_block = block_m >= block_n

    dq = torch.empty_like(out)
    if single_block:
        dk, dv = torch.empty_like(out), torch.empty_like(out)
        dk_acc = dv_acc = _dummy(q)
    else:
        dk = dv = dq  # unused by the kernel in this mode
        dk_acc = torch.zeros_like(out, dtype=torch.float32)
        dv_acc = torch.zeros_like(out, dtype=torch.float32)
    assert dq.stride() == out.stride() and (single_block or dk_acc.stride() == out.stride())
    has_dbias = bool(need_bias_grad and bias is not None)
    dbias = torch.zeros((heads, n, n), device=q.device, dtype=torch.float32) if has_dbias else _dummy(q)
    assert attn_add.shape == (attn_add.shape[0], heads, block_n, block_n) and attn_add.is_contiguous()

    def grid(meta):
        return (triton.cdiv(windows, meta["WINDOWS_PER_PROGRAM"]), heads)

    _launch(
        _bwd_kernel, grid,
        q, k, v, attn_add, out, grad_out, lse,
        dq, dk, dv, dk_acc, dv_acc, dbias,
        scale, heads, windows, attn_add.shape[0],
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
        n, d,
        HAS_DBIAS=has_dbias, ALLOW_TF32=_allow_tf32(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    if not single_block:
        dk, dv = dk_acc.to(q.dtype), dv_acc.to(q.dtype)
    return dq, dk, dv, (dbias.to(bias.dtype) if has_dbias else None)
