"""Triton kernels of the layer-wise optimizers' steps over many tensors at once (LAMB, LARS).

A layer-wise step needs each tensor's norms before it may update the tensor. apex's ``FusedLAMB`` does it in two
multi-tensor launches: the moments and the update with the norms' partial sums, then the trust-ratio step. These
kernels have the same shape. A launch covers every tensor of a group: the launcher (`aiak.optim._triton.layerwise`)
gives the kernel a table of the tensors' addresses (int64, read back as pointers in the kernel) and a block map
(one program per ``BLOCK`` elements of one tensor: its tensor and its first element), so one launch serves any
number of tensors of any sizes, as apex's ``multi_tensor_apply`` does with its chunk lists.

* `_lamb_moments_kernel`: reads ``w, g, m, v``; writes the new moments; with ``ADAPT`` stores the program's partial
  sums of ``w^2`` and ``u^2``, without it (trust ratio 1) takes the step at once.
* `_lars_squares_kernel`: the partial sums of ``w^2`` and ``g^2``.
* `_sum_partials_kernel`: one program per tensor adds its blocks' partial sums in float64, in a fixed order (no
  atomics: the same inputs give the same bits).
* `_lamb_update_kernel`, `_lars_update_kernel`: the step with each tensor's ratio. LAMB's update ``u`` is computed
  again from ``w, m, v`` rather than stored by the first kernel: the same 10 reads and writes per element, no
  scratch tensor and the gradients left as they are.

The maths is in fp32 whatever the parameters' dtype (fp32 moments and buffers; fp16/bf16 weights rounded once on
the way out), as the torch paths of `aiak.optim.lamb` and `aiak.optim.lars`, the reference these kernels are tested
against (and the float64 transcriptions of the papers). Nothing here touches a device at import.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block(BLOCK_TENSOR, BLOCK_START, SIZES, BLOCK: tl.constexpr):
    """This program's tensor, its element offsets and their mask."""
    pid = tl.program_id(0)
    i = tl.load(BLOCK_TENSOR + pid)
    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    return pid, i, offs, offs < tl.load(SIZES + i)


@triton.jit
def _lamb_update_of(w, m, v, eps_hat, step_size, weight_decay):
    """``u = step_size * m / (sqrt(v) + eps_hat) + weight_decay * w``: Adam's bias-corrected direction (the
    corrections folded into ``step_size`` and ``eps_hat``) plus the decoupled decay."""
    return step_size * m / (tl.sqrt(v) + eps_hat) + weight_decay * w


@triton.jit
def _lamb_moments_kernel(W_PTRS, G_PTRS, M_PTRS, V_PTRS, BLOCK_TENSOR, BLOCK_START, SIZES, PARTIALS,
                         grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps_hat, step_size, weight_decay,
                         lr, PARAM: tl.constexpr, ADAPT: tl.constexpr, BLOCK: tl.constexpr):
    pid, i, offs, mask = _block(BLOCK_TENSOR, BLOCK_START, SIZES, BLOCK)
    w_ptr = tl.load(W_PTRS + i).to(tl.pointer_type(PARAM))
    g_ptr = tl.load(G_PTRS + i).to(tl.pointer_type(PARAM))
    m_ptr = tl.load(M_PTRS + i).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(V_PTRS + i).to(tl.pointer_type(tl.float32))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + one_minus_beta1 * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = tl.where(mask, _lamb_update_of(w, m, v, eps_hat, step_size, weight_decay), 0.0)
    if ADAPT:
        tl.store(PARTIALS + 2 * pid, tl.sum(w * w, axis=0))
        tl.store(PARTIALS + 2 * pid + 1, tl.sum(u * u, axis=0))
    else:
        tl.store(w_ptr + offs, (w - lr * u).to(PARAM), mask=mask)


@triton.jit
def _lamb_update_kernel(W_PTRS, M_PTRS, V_PTRS, BLOCK_TENSOR, BLOCK_START, SIZES, RATIOS,
                        eps_hat, step_size, weight_decay, lr, PARAM: tl.constexpr, BLOCK: tl.constexpr):
    _, i, offs, mask = _block(BLOCK_TENSOR, BLOCK_START, SIZES, BLOCK)
    w_ptr = tl.load(W_PTRS + i).to(tl.pointer_type(PARAM))
    m_ptr = tl.load(M_PTRS + i).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(V_PTRS + i).to(tl.pointer_type(tl.float32))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0)
    u = _lamb_update_of(w, m, v, eps_hat, step_size, weight_decay)
    tl.store(w_ptr + offs, (w - (lr * tl.load(RATIOS + i)) * u).to(PARAM), mask=mask)


@triton.jit
def _lars_squares_kernel(W_PTRS, G_PTRS, BLOCK_TENSOR, BLOCK_START, SIZES, PARTIALS, PARAM: tl.constexpr,
                         BLOCK: tl.constexpr):
    pid, i, offs, mask = _block(BLOCK_TENSOR, BLOCK_START, SIZES, BLOCK)
    w = tl.load(tl.load(W_PTRS + i).to(tl.pointer_type(PARAM)) + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(tl.load(G_PTRS + i).to(tl.pointer_type(PARAM)) + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(PARTIALS + 2 * pid, tl.sum(w * w, axis=0))
    tl.store(PARTIALS + 2 * pid + 1, tl.sum(g * g, axis=0))


@triton.jit
def _lars_update_kernel(W_PTRS, G_PTRS, B_PTRS, BLOCK_TENSOR, BLOCK_START, SIZES, RATIOS, lr, momentum,
                        weight_decay, PARAM: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                        ADAPT: tl.constexpr, BLOCK: tl.constexpr):
    """``d = r * (g + weight_decay * w)``; ``buf = momentum * buf + d``; ``w -= lr * (d + momentum * buf)`` with
    Nesterov, ``w -= lr * buf`` without, ``w -= lr * d`` with no momentum (``r = 1`` without ``ADAPT``)."""
    _, i, offs, mask = _block(BLOCK_TENSOR, BLOCK_START, SIZES, BLOCK)
    w_ptr = tl.load(W_PTRS + i).to(tl.pointer_type(PARAM))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(tl.load(G_PTRS + i).to(tl.pointer_type(PARAM)) + offs, mask=mask, other=0.0).to(tl.float32)
    d = g + weight_decay * w
    if ADAPT:
        d = tl.load(RATIOS + i) * d
    if MOMENTUM:
        b_ptr = tl.load(B_PTRS + i).to(tl.pointer_type(tl.float32))
        buf = momentum * tl.load(b_ptr + offs, mask=mask, other=0.0) + d
        tl.store(b_ptr + offs, buf, mask=mask)
        if NESTEROV:
            d = d + momentum * buf
        else:
            d = buf
    tl.store(w_ptr + offs, (w - lr * d).to(PARAM), mask=mask)


@triton.jit
def _sum_partials_kernel(PARTIALS, FIRST_BLOCK, SQUARES, RBLOCK: tl.constexpr):
    """Tensor ``i``'s two sums over its blocks ``FIRST_BLOCK[i] .. FIRST_BLOCK[i + 1]``, in float64, into
    ``SQUARES[i, 0:2]`` (fp32)."""
    i = tl.program_id(0)
    first = tl.load(FIRST_BLOCK + i)
    last = tl.load(FIRST_BLOCK + i + 1)
    first_sum = tl.zeros([RBLOCK], dtype=tl.float64)
    second_sum = tl.zeros([RBLOCK], dtype=tl.float64)
    for start in range(first, last, RBLOCK):
        blocks = start + tl.arange(0, RBLOCK)
        inside = blocks < last
        first_sum += tl.load(PARTIALS + 2 * blocks, mask=inside, other=0.0).to(tl.float64)
        second_sum += tl.load(PARTIALS + 2 * blocks + 1, mask=inside, other=0.0).to(tl.float64)
    tl.store(SQUARES + 2 * i, tl.sum(first_sum, axis=0).to(tl.float32))
    tl.store(SQUARES + 2 * i + 1, tl.sum(second_sum, axis=0).to(tl.float32))
