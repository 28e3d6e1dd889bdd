"""Fused window attention for Swin Transformers.

Swin (Liu et al., "Swin Transformer: Hierarchical Vision Transformer using Shifted Windows", ICCV 2021,
Eq. 4) computes, for every window and head,

    Attention(Q, K, V) = SoftMax(Q K^T / sqrt(d) + B + M) V

where ``B`` is the learned relative position bias (one ``[N, N]`` table per head, shared by every window)
and ``M`` the shifted-window mask (one ``[N, N]`` matrix per window position, 0 or a large negative
number). Eager PyTorch spends about ten kernel launches on this and materialises the ``[windows, H, N, N]``
score tensor several times. This module provides:

* `window_attention` - the public functional form; picks a backend.
* `TritonWindowAttention` - autograd.Function over the Triton kernels (``aiak/ops/_triton``):
  one forward launch, one backward launch that also reduces the bias gradient over windows.
* `torch_window_attention` - the fastest exact torch path: ``scaled_dot_product_attention`` with
  bias and mask folded into one small ``[nW * H, N, N]`` additive mask broadcast over the batch.
* `reference_window_attention` - the eager formula, used as the numerical baseline in tests.

A Triton kernel that cannot launch on the device (``OutOfResources``: no autotune config fits, e.g. the
shared memory of fp32 N=256 D=128 tiles) makes that shape fall back to the torch path, with one warning:
a forward that cannot launch runs the torch path; a backward that cannot launch recomputes the gradients
through it. The shape is remembered, so later calls go straight to torch (training calls only, when it
was the backward that did not fit).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Dict, Optional, Set, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "window_attention",
    "torch_window_attention",
    "reference_window_attention",
    "TritonWindowAttention",
    "triton_supports",
    "BACKENDS",
]

BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The Triton kernels keep a whole window row ([BLOCK_M, next_pow2(N)] scores) in registers.
TRITON_MAX_N = 256
TRITON_MAX_D = 128
# On CPU, training through the SDPA path (whose backward recomputes the probabilities) beats eager only on
# large batches of windows: benchmarks/window_attention.py, fwd+bwd, Swin-T/S/B at batch 64, 2 threads:
# windows x heads >= 6144 (stages 1-2) 1.19-1.44x eager, <= 4096 (stages 3-4) 0.85-1.06x. Below this
# size, "auto" trains with the eager formula (the forward alone is faster through SDPA at every stage).
CPU_TRAINING_SDPA_MIN_WINDOW_HEADS = 6000


def _check_inputs(q, k, v, bias, mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"window_attention: {name} must be a 4-d tensor [B*nW, H, N, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"window_attention: {name} has dtype {t.dtype}; valid choices: {_FLOAT_DTYPES}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"window_attention: q, k, v must have the same shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"window_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    windows, heads, n, _ = q.shape
    for name, t in (("k", k), ("v", v), ("bias", bias), ("mask", mask)):
        if t is not None and t.device != q.device:
            raise ValueError(f"window_attention: {name} is on {t.device} but q is on {q.device}")
    if bias is not None and tuple(bias.shape) != (heads, n, n):
        raise ValueError(f"window_attention: bias must have shape [H, N, N] = {(heads, n, n)}, "
                         f"got {tuple(bias.shape)}")
    if mask is not None:
        if mask.dim() != 3 or tuple(mask.shape[1:]) != (n, n):
            raise ValueError(f"window_attention: mask must have shape [nW, N, N] with N={n}, got {tuple(mask.shape)}")
        if mask.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"window_attention: mask must be an additive floating mask (0 / large negative), "
                            f"got dtype {mask.dtype}")
        if windows % mask.shape[0] != 0:
            raise ValueError(f"window_attention: the batch of windows ({windows}) must be a multiple of the "
                             f"number of mask windows nW={mask.shape[0]} (window index = batch index mod nW)")
        if mask.requires_grad:
            raise ValueError("window_attention: mask must not require grad (it is a constant shift mask)")


def reference_window_attention(q, k, v, bias=None, mask=None, scale=None):
    """The eager Swin formula (original Swin-Transformer ``WindowAttention.forward``), in q's dtype."""
    windows, heads, n, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    attn = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:
        attn = attn + bias.to(attn.dtype).unsqueeze(0)
    if mask is not None:
        nw = mask.shape[0]
        attn = attn.view(windows // nw, nw, heads, n, n) + mask.to(attn.dtype).unsqueeze(1).unsqueeze(0)
        attn = attn.view(windows, heads, n, n)
    return attn.softmax(dim=-1) @ v


def _combined_mask(bias, mask, heads, n, dtype):
    """Bias and shift mask folded into one additive mask of shape [1, nW*H, N, N] (or [1, H, N, N])."""
    if mask is None:
        return bias.to(dtype).unsqueeze(0)
    if bias is None:
        combined = mask.to(dtype).unsqueeze(1).expand(-1, heads, n, n)
    else:
        combined = mask.to(dtype).unsqueeze(1) + bias.to(dtype).unsqueeze(0)
    return combined.reshape(1, -1, n, n)


def _sdpa_windows(q, k, v, bias, mask, scale):
    """One SDPA call over ``[B, nW*H, N, D]`` views with the ``[1, nW*H, N, N]`` bias+mask."""
    windows, heads, n, d = q.shape
    attn_mask = _combined_mask(bias, mask, heads, n, q.dtype)
    if not torch.is_grad_enabled():
        # A mask that still requires grad (a parameter viewed under no_grad) sends SDPA to its slow math path.
        attn_mask = attn_mask.detach()
    groups = 1 if mask is None else mask.shape[0]
    shape = (windows // groups, groups * heads, n, d)
    out = F.scaled_dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                                         attn_mask=attn_mask, scale=scale)
    # CUDA's memory-efficient kernel returns a [B, N, nW*H, D] buffer seen as [B, nW*H, N, D], which no view
    # can split back into windows: reshape copies only then.
    return out.reshape(windows, heads, n, d)


class _SDPAWithBiasGrad(torch.autograd.Function):
    """SDPA forward (no probabilities kept), backward that recomputes P once and reduces dbias.

    Autograd through SDPA with a mask that requires grad falls back to the unfused math path, which
    stores the ``[B*nW, H, N, N]`` probabilities; here the forward keeps only q, k, v and the output
    (FlashAttention-style recomputation, Dao et al. 2022, Sec. 3.1) and the backward uses in-place ops.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale):
        out = _sdpa_windows(q, k, v, bias, mask, scale)
        ctx.save_for_backward(q, k, v, bias, mask, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, mask, out = ctx.saved_tensors
        scale = ctx.scale
        windows, heads, n, d = q.shape
        groups = 1 if mask is None else mask.shape[0]
        shape = (windows // groups, groups * heads, n, d)
        qv, kv, vv, ov, gv = (t.reshape(shape) for t in (q, k, v, out, grad_out))
        probs = torch.matmul(qv, kv.transpose(-2, -1)).mul_(scale)
        probs = probs.add_(_combined_mask(bias, mask, heads, n, q.dtype)).softmax(dim=-1)
        dv = torch.matmul(probs.transpose(-2, -1), gv) if ctx.needs_input_grad[2] else None
        dscores = torch.matmul(gv, vv.transpose(-2, -1))
        dscores = dscores.sub_((gv * ov).sum(dim=-1, keepdim=True)).mul_(probs)
        del probs
        dbias = None
        if ctx.needs_input_grad[3]:
            dbias = dscores.sum(dim=0).view(groups, heads, n, n).sum(dim=0).to(bias.dtype)
        dq = torch.matmul(dscores, kv).mul_(scale).view(windows, heads, n, d) if ctx.needs_input_grad[0] else None
        dk = (torch.matmul(dscores.transpose(-2, -1), qv).mul_(scale).view(windows, heads, n, d)
              if ctx.needs_input_grad[1] else None)
        return dq, dk, None if dv is None else dv.view(windows, heads, n, d), dbias, None, None


def torch_window_attention(q, k, v, bias=None, mask=None, scale=None):
    """Exact torch path built on one ``scaled_dot_product_attention`` call.

    ``[B*nW, H, N, D]`` is viewed as ``[B, nW*H, N, D]`` so that the combined bias+mask is only
    ``[1, nW*H, N, N]`` (broadcast over B, never materialised per batch element). When the bias needs a
    gradient, `_SDPAWithBiasGrad` supplies a recomputing backward that sums it over windows;
    otherwise SDPA's own backward runs.
    """
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    if bias is None and mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if bias is not None and bias.requires_grad and torch.is_grad_enabled():
        return _SDPAWithBiasGrad.apply(q, k, v, bias, mask, scale)
    return _sdpa_windows(q, k, v, bias, mask, scale)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _import_triton_launchers():
    try:
        from aiak.ops._triton import window_attention as launchers
    except ImportError as err:  # triton missing (or broken) on this machine
        raise ImportError("the Triton window-attention backend needs triton: pip install 'aiak[triton]'") from err
    return launchers


def triton_supports(q, bias=None, mask=None) -> Optional[str]:
    """None when the Triton kernels can run these inputs, else the reason they cannot."""
    if not (q.is_cuda or _interpreting()):
        return "inputs are not on a CUDA device (and TRITON_INTERPRET is not set)"
    if q.dtype not in _TRITON_DTYPES:
        return f"dtype {q.dtype} (kernels cover {_TRITON_DTYPES})"
    n, d = q.shape[-2:]
    if n > TRITON_MAX_N or d > TRITON_MAX_D:
        return f"window area N={n} / head dim D={d} above the kernel limits ({TRITON_MAX_N}, {TRITON_MAX_D})"
    return None


# Shapes whose Triton kernels cannot launch on their device -> the passes ("forward", "backward") that
# could not. Filled on the first OutOfResources, read before every Triton launch.
_TRITON_UNFIT: Dict[Tuple, Set[str]] = {}


def _fit_key(q, bias, mask) -> Tuple:
    """What decides whether the kernels fit: device, dtype, N, D and which optional inputs are compiled in."""
    return (str(q.device), q.dtype, q.shape[-2], q.shape[-1], bias is not None, mask is not None)


def _give_up_triton(pass_name: str, q, bias, mask, err: Exception) -> None:
    """Remember that ``pass_name`` cannot launch for this shape; warn the first time."""
    unfit = _TRITON_UNFIT.setdefault(_fit_key(q, bias, mask), set())
    if pass_name in unfit:
        return
    unfit.add(pass_name)
    n, d = q.shape[-2:]
    inputs = ", ".join(name for name, t in (("bias", bias), ("mask", mask)) if t is not None) or "no bias/mask"
    tried = getattr(err, "tried_configs", "?")  # set by the launcher
    logging.getLogger("aiak").warning(
        "window_attention: the Triton %s kernel cannot launch on %s for %s N=%d D=%d (%s): every autotune config "
        "tried (%s) failed [%s]. This shape takes the torch (SDPA) path from now on%s; results are unchanged "
        "(the same attention within the usual tolerances), only unfused.",
        pass_name, q.device, str(q.dtype).replace("torch.", ""), n, d, inputs, tried, err,
        " when training (inference keeps the Triton forward)" if pass_name == "backward" else "")


def _triton_unfit_for(q, k, v, bias, mask) -> bool:
    """Whether an earlier OutOfResources already sent this call's shape to the torch path."""
    unfit = _TRITON_UNFIT.get(_fit_key(q, bias, mask), ())
    return "forward" in unfit or ("backward" in unfit and _needs_grad(q, k, v, bias))


def _torch_gradients(ctx, grad_out, q, k, v, bias, mask):
    """Gradients of the torch path at the saved inputs: the backward of a call whose kernel cannot launch."""
    needs = ctx.needs_input_grad[:4]
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip((q, k, v, bias), needs)]
        out = torch_window_attention(*leaves, mask, ctx.scale)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out))
    return tuple(next(grads) if t is not None and t.requires_grad else None for t in leaves) + (None, None)


class TritonWindowAttention(torch.autograd.Function):
    """Triton forward (saves only the output and the row log-sum-exp) and single-launch backward.

    A backward kernel that cannot launch (``OutOfResources``) recomputes the gradients through the torch
    path. A forward that cannot launch raises ``OutOfResources``; `window_attention` falls back.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, scale):
        launchers = _import_triton_launchers()
        out, lse, attn_add = launchers.window_attention_forward(q, k, v, bias, mask, scale)
        ctx.save_for_backward(q, k, v, bias, mask, out, lse, attn_add)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, mask, out, lse, attn_add = ctx.saved_tensors
        launchers = _import_triton_launchers()
        need_bias_grad = bias is not None and ctx.needs_input_grad[3]
        try:
            dq, dk, dv, dbias = launchers.window_attention_backward(
                grad_out, q, k, v, bias, mask, out, lse, attn_add, ctx.scale, need_bias_grad)
        except launchers.OutOfResources as err:
            _give_up_triton("backward", q, bias, mask, err)
            return _torch_gradients(ctx, grad_out, q, k, v, bias, mask)
        return dq, dk, dv, dbias, None, None


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     mask: Optional[torch.Tensor] = None, scale: Optional[float] = None, *,
                     backend: str = "auto") -> torch.Tensor:
    """Swin window attention `softmax(q k^T * scale + bias + mask) v`, fused.

    Swin's attention over many small windows is launch-bound in eager PyTorch (a matmul, an add, a softmax and a
    matmul per block); one kernel (Triton on CUDA, one SDPA call elsewhere) computes it without materialising the
    attention matrix in memory.

    Args:
        q: the queries, `[B*nW, H, N, D]` (N = window area, e.g. 49; any strides with a unit last stride
            are fine for the Triton path). fp32, fp16 or bf16 (fp64 on the torch path).
        k: the keys, shaped and typed as `q`.
        v: the values, shaped and typed as `q`.
        bias: `[H, N, N]` relative position bias shared by all windows, or None. Differentiable:
            its gradient is summed over windows.
        mask: `[nW, N, N]` additive shift mask, or None; window `i` of the batch uses `mask[i % nW]`.
        scale: defaults to `D ** -0.5`.
        backend: `"auto"` (Triton on CUDA when it supports the shapes, else torch), `"triton"`
            (CUDA, or CPU under `TRITON_INTERPRET=1`), `"torch"` (one SDPA call). With either of the
            first two, a shape whose kernel cannot launch on the device (`OutOfResources`) takes the
            torch path instead, with one warning (see the module docstring).

    Returns:
        `[B*nW, H, N, D]` in q's dtype. The Triton path lays it out as `[B*nW, N, H, D]` (a transposed
            view) so the usual `out.transpose(1, 2).reshape(B*nW, N, C)` that follows is free.

    Raises:
        ValueError: an unknown `backend`, shapes that do not fit together (q, k, v not 4-D or not alike, a bias
            other than `[H, N, N]`, a mask other than `[nW, N, N]` or one that requires grad, a batch that is not a
            multiple of the mask's windows), tensors on different devices, a scale that is not finite, or
            `backend="triton"` for inputs its kernels cannot run.
        TypeError: an unsupported dtype, q, k, v of different dtypes, or a mask that is not floating.
    """
    if backend not in BACKENDS:
        raise ValueError(f"window_attention: backend={backend!r}; valid choices: {BACKENDS}")
    _check_inputs(q, k, v, bias, mask)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"window_attention: scale must be finite, got {scale}")
    if backend == "auto":
        use_triton = q.is_cuda and triton_supports(q, bias, mask) is None and _triton_available()
    elif backend == "triton":
        reason = triton_supports(q, bias, mask)
        if reason is not None:
            raise ValueError(f"window_attention: backend='triton' cannot run: {reason}")
        use_triton = True
    else:
        use_triton = False
    if use_triton and not _triton_unfit_for(q, k, v, bias, mask):
        launchers = _import_triton_launchers()
        try:
            return TritonWindowAttention.apply(q, k, v, bias, mask, scale)
        except launchers.OutOfResources as err:
            _give_up_triton("forward", q, bias, mask, err)
    if use_triton:  # a kernel of this shape cannot launch on this device
        return torch_window_attention(q, k, v, bias, mask, scale)
    if backend == "auto" and not q.is_cuda and _needs_grad(q, k, v, bias) \
            and q.shape[0] * q.shape[1] < CPU_TRAINING_SDPA_MIN_WINDOW_HEADS:
        return reference_window_attention(q, k, v, bias, mask, scale)
    return torch_window_attention(q, k, v, bias, mask, scale)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_TRITON_AVAILABLE: Optional[bool] = None


def _triton_available() -> bool:
    """Whether triton imports (checked once, on the first CUDA call; never at aiak import)."""
    global _TRITON_AVAILABLE
    if _TRITON_AVAILABLE is None:
        try:
            _import_triton_launchers()
            _TRITON_AVAILABLE = True
        except ImportError as err:
            _TRITON_AVAILABLE = False
            logging.getLogger("aiak").warning("window_attention: %s; using the torch (SDPA) path on CUDA", err)
    return _TRITON_AVAILABLE
