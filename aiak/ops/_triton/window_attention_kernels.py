"""Triton kernels for Swin window attention ``softmax(Q K^T * scale + B + M) V``.

A Swin window is small (N = 49, 64, 144 tokens), so unlike FlashAttention (Dao et al., 2022,
Algorithm 1) a whole score row fits in one tile: the forward needs no online softmax, just one
``[BLOCK_M, BLOCK_N]`` tile per (window, head, query block) with ``BLOCK_N = next_pow2(N)``; rows past N
are masked inside the kernel. Bias and shift mask arrive summed into one padded fp32 tensor
``[G, H, BLOCK_N, BLOCK_N]`` whose padded columns hold -inf (the launcher's ``additive_tile``), so each
tile is a single aligned, unmasked, vectorised load: reading the two ``[N, N]`` tensors directly at row
stride N = 49 took element-wise loads and kept the forward bound on L1 traffic and integer address
arithmetic (Nsight Compute on an H200: L1 85% busy, DRAM 29%). The forward stores the output and the row
log-sum-exp.

The backward follows FlashAttention-2 (Dao, 2023, Algorithm 2) with one change for Swin: the bias ``B``
is a parameter shared by every window, so ``dB[h] = sum_w dS[w, h]``. One program owns one head and a
group of ``WINDOWS_PER_PROGRAM`` windows; it accumulates ``dB`` for its group in registers and adds it
to the global fp32 buffer with one atomic add per query block, which keeps the whole backward in a
single launch. When a window spans several query blocks (N > BLOCK_M), the partial dK/dV of each block
are added atomically into fp32 buffers (owned by this program only, so there is no contention).

Autotune configs are keyed on (N, D) and the argument dtypes (Triton appends those to the key). N and D are
compile-time constants (a kernel per window size, as the autotuner keys anyway): row and head-dim masks fold
away, and the backward's 64x64 tiles fit in registers without spilling (ptxas, sm_90: 186 registers, no
stack, against 255 and a 40-byte stack with N and D as arguments).
Nothing here touches a device at import; under ``TRITON_INTERPRET=1`` only the first config runs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _interpret_prune(configs, named_args, **kwargs):
    # The interpreter cannot time configs (no device); any one config is correct.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return configs[:1]
    return configs


@triton.jit
def _tile_ptrs(base, win, head, rows, cols, stride_b, stride_h, stride_n):
    """Pointers to the [rows, cols] tile of (window, head) in a [B*nW, H, N, D] tensor with unit D stride."""
    return base + win * stride_b + head * stride_h + rows[:, None] * stride_n + cols[None, :]


@triton.jit
def _add_tile_ptrs(base, win, head, num_heads, num_add_groups, rows, cols, BLOCK_N: tl.constexpr):
    """Pointers to the [rows, cols] tile of window ``win``, head ``head`` in the padded additive tensor."""
    group = win % num_add_groups
    return base + (group * num_heads + head) * BLOCK_N * BLOCK_N + rows[:, None] * BLOCK_N + cols[None, :]


def _fwd_configs():
    return [triton.Config({"BLOCK_M": bm}, num_warps=w, num_stages=1)
            for bm, w in ((16, 2), (32, 4), (64, 4), (32, 8), (64, 8))]


# fp32 without TF32: tl.dot runs on the FMA units and Triton stages the whole K and V tiles in shared memory
# at once, 2 x 128 KB at BLOCK_N x BLOCK_D = 256 x 128, before Q's tile. Compiled for sm_90 (Triton 3.8) the
# forward needs 270,336 B at BLOCK_M=16 and 278,528 B at 32; an H100/H200 has 232,448 B per block. Since a
# taller query block only needs more, only the smallest is tried: its launch raises OutOfResources and
# window_attention falls back to torch after one compile, not five (on this project's 2-core CPU machine the
# compile took 53 s at BLOCK_M=16; at 64 ptxas was still running after 7 minutes). With TF32 the MMA path
# needs 147,456 B at BLOCK_M=16 and 163,840 B at 32, so it keeps every config.
_FMA_FP32_MAX_TILE = 256 * 128


def _fwd_prune(configs, named_args, **kwargs):
    configs = _interpret_prune(configs, named_args, **kwargs)
    # A query block taller than the padded window only adds masked rows.
    n_pad = max(16, triton.next_power_of_2(named_args["N_CTX"]))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= n_pad] or configs[:1]
    if (named_args["Q"].dtype == torch.float32 and not kwargs["ALLOW_TF32"]
            and kwargs["BLOCK_N"] * kwargs["BLOCK_D"] >= _FMA_FP32_MAX_TILE):
        kept = [min(kept, key=lambda c: c.kwargs["BLOCK_M"])]
    return kept


@triton.autotune(configs=_fwd_configs(), key=["N_CTX", "HEAD_DIM"],
                 prune_configs_by={"early_config_prune": _fwd_prune})
@triton.jit
def _fwd_kernel(
    Q, K, V,            # [B*nW, H, N, D], unit stride on D
    AttnAdd,            # [G, H, BLOCK_N, BLOCK_N] fp32 contiguous: bias + mask, padded (see additive_tile)
    Out,                # [B*nW, H, N, D] (any strides, unit on D), written
    Lse,                # [B*nW, H, N] fp32 contiguous, written: log-sum-exp of each score row
    sm_scale, num_heads, num_add_groups,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    N_CTX: tl.constexpr, HEAD_DIM: tl.constexpr,
    ALLOW_TF32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # windows * heads on axis 0: axis 1 is limited to 65535 on CUDA
    pid_m = tl.program_id(1)
    win = pid_bh // num_heads
    head = pid_bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < N_CTX
    col_ok = offs_n < N_CTX
    d_ok = offs_d < HEAD_DIM

    md_ok = row_ok[:, None] & d_ok[None, :]
    nd_ok = col_ok[:, None] & d_ok[None, :]
    q = tl.load(_tile_ptrs(Q, win, head, offs_m, offs_d, stride_qb, stride_qh, stride_qn), mask=md_ok, other=0.0)
    k = tl.load(_tile_ptrs(K, win, head, offs_n, offs_d, stride_kb, stride_kh, stride_kn), mask=nd_ok, other=0.0)
    v = tl.load(_tile_ptrs(V, win, head, offs_n, offs_d, stride_vb, stride_vh, stride_vn), mask=nd_ok, other=0.0)

    scores = tl.dot(q, tl.trans(k), input_precision="tf32" if ALLOW_TF32 else "ieee") * sm_scale
    # One aligned, unmasked tile load brings bias, mask and the -inf of the padded columns.
    scores += tl.load(_add_tile_ptrs(AttnAdd, win, head, num_heads, num_add_groups, offs_m, offs_n, BLOCK_N))

    row_max = tl.max(scores, axis=1)
    p = tl.exp(scores - row_max[:, None])
    row_sum = tl.sum(p, axis=1)
    # normalised after the product: N x D divisions instead of N x N (P's largest entry is 1 either way)
    out = tl.dot(p.to(v.dtype), v, input_precision="tf32" if ALLOW_TF32 else "ieee") / row_sum[:, None]

    tl.store(_tile_ptrs(Out, win, head, offs_m, offs_d, stride_ob, stride_oh, stride_on),
             out.to(Out.dtype.element_ty), mask=md_ok)
    tl.store(Lse + (win * num_heads + head) * N_CTX + offs_m, row_max + tl.log(row_sum), mask=row_ok)


def _bwd_configs():
    # Few configs on purpose: each one is a compile on first use. ptxas (sm_90, fp16, N=49) reports
    # ~1 KB of spills at 4 warps and ~160 B at 8 for the 64x64 backward tile; 4 warps stays for small N.
    # More windows per program means fewer atomic adds of the bias gradient (one [BLOCK_M, BLOCK_N] tile per
    # program and query block) but fewer programs to fill the GPU: 64 leaves 256 programs at Swin-B stage 1.
    return [triton.Config({"WINDOWS_PER_PROGRAM": wpp}, num_warps=w, num_stages=1)
            for wpp in (8, 32, 64) for w in (4, 8)]


def _bwd_prune(configs, named_args, **kwargs):
    configs = _interpret_prune(configs, named_args, **kwargs)
    if named_args["N_CTX"] > 32:
        configs = [c for c in configs if c.num_warps >= 8] or configs
    return configs


@triton.autotune(configs=_bwd_configs(), key=["N_CTX", "HEAD_DIM"],
                 prune_configs_by={"early_config_prune": _bwd_prune},
                 reset_to_zero=["DBias", "DKAcc", "DVAcc"])
@triton.jit
def _bwd_kernel(
    Q, K, V,            # [B*nW, H, N, D], unit stride on D
    AttnAdd,            # as in _fwd_kernel
    Out,                # [B*nW, H, N, D] from the forward; DQ, DK, DV, DKAcc, DVAcc share its strides
    DOut,               # [B*nW, H, N, D] incoming gradient (own strides)
    Lse,                # [B*nW, H, N] fp32 contiguous, from the forward
    DQ, DK, DV,         # written (DK/DV only when SINGLE_BLOCK)
    DKAcc, DVAcc,       # fp32 zeroed accumulators (used only when not SINGLE_BLOCK)
    DBias,              # fp32 [H, N, N] contiguous, zeroed, accumulated (used only when HAS_DBIAS)
    sm_scale, num_heads, num_windows, num_add_groups,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_gb, stride_gh, stride_gn,
    N_CTX: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_DBIAS: tl.constexpr, ALLOW_TF32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOWS_PER_PROGRAM: tl.constexpr,
):
    SINGLE_BLOCK: tl.constexpr = BLOCK_M >= BLOCK_N
    PRECISION: tl.constexpr = "tf32" if ALLOW_TF32 else "ieee"
    group = tl.program_id(0)
    head = tl.program_id(1)
    win_start = group * WINDOWS_PER_PROGRAM
    win_end = tl.minimum(win_start + WINDOWS_PER_PROGRAM, num_windows)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < N_CTX
    d_ok = offs_d < HEAD_DIM
    kv_ok = col_ok[:, None] & d_ok[None, :]

    for m_start in range(0, N_CTX, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < N_CTX
        md_ok = row_ok[:, None] & d_ok[None, :]
        tile = offs_m[:, None] * N_CTX + offs_n[None, :]
        tile_ok = row_ok[:, None] & col_ok[None, :]
        dbias = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for win in range(win_start, win_end):
            q = tl.load(_tile_ptrs(Q, win, head, offs_m, offs_d, stride_qb, stride_qh, stride_qn),
                        mask=md_ok, other=0.0)
            k = tl.load(_tile_ptrs(K, win, head, offs_n, offs_d, stride_kb, stride_kh, stride_kn),
                        mask=kv_ok, other=0.0)
            v = tl.load(_tile_ptrs(V, win, head, offs_n, offs_d, stride_vb, stride_vh, stride_vn),
                        mask=kv_ok, other=0.0)
            do = tl.load(_tile_ptrs(DOut, win, head, offs_m, offs_d, stride_gb, stride_gh, stride_gn),
                         mask=md_ok, other=0.0)
            o_offs = win * stride_ob + head * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
            o = tl.load(Out + o_offs, mask=md_ok, other=0.0)
            lse = tl.load(Lse + (win * num_heads + head) * N_CTX + offs_m, mask=row_ok, other=0.0)

            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
            # re-read per window (cache-resident) rather than pinning a tile of registers; padded columns
            # hold -inf, so P is 0 there
            scores += tl.load(_add_tile_ptrs(AttnAdd, win, head, num_heads, num_add_groups, offs_m, offs_n,
                                             BLOCK_N))
            p = tl.exp(scores - lse[:, None])

            # dS = P * (dO V^T - rowsum(dO * O)); padded rows have dO = O = 0, so dS = 0 there.
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
            ds = p * (dp - delta[:, None])
            if HAS_DBIAS:
                dbias += ds

            dq = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * sm_scale
            tl.store(DQ + o_offs, dq.to(DQ.dtype.element_ty), mask=md_ok)
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * sm_scale
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            nd_offs = win * stride_ob + head * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :]
            if SINGLE_BLOCK:
                tl.store(DK + nd_offs, dk.to(DK.dtype.element_ty), mask=kv_ok)
                tl.store(DV + nd_offs, dv.to(DV.dtype.element_ty), mask=kv_ok)
            else:
                tl.atomic_add(DKAcc + nd_offs, dk, mask=kv_ok)
                tl.atomic_add(DVAcc + nd_offs, dv, mask=kv_ok)
        if HAS_DBIAS:
            tl.atomic_add(DBias + head * N_CTX * N_CTX + tile, dbias, mask=tile_ok)
