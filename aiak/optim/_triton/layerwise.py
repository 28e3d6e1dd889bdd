"""Launchers of the layer-wise kernels (`aiak.optim._triton.layerwise_kernels`): tensor tables, grids, the passes.

A pass takes lists of tensors of one dtype on one device, each parameter's gradient and state in its own dense
layout (`aiak.optim._multi_tensor.same_layout`), and launches one kernel over all of them: LAMB's moments (with the
partial sums of the norms), then one program per tensor to add the partial sums (`_squares`), then the update with
each tensor's ratio; LARS's norms, then its update. The trust ratios between the passes are the optimizers' own
(`aiak.optim.lamb`, `aiak.optim.lars`), so that a sharded step can sum the squares over ranks in between
(`aiak.optim.sharded`).

The tables (each tensor's address, size, and the programs' block map) are small int64 tensors on the device, made
once for a list of addresses or sizes and reused while they do not change (an optimizer's parameters and state keep
theirs; a gradient made anew each step gets a new address table, an 8-byte-per-tensor copy).
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch
import triton.language as tl

from aiak.optim._triton.layerwise_kernels import (_lamb_moments_kernel, _lamb_update_kernel, _lars_squares_kernel,
                                                  _lars_update_kernel, _sum_partials_kernel)

__all__ = ["DTYPES", "lamb_moments", "lamb_apply", "lars_squares", "lars_apply"]

BLOCK = 1024        # elements per program: 4 warps x 8 fp32 lanes x 32, one 4 KB read per array
RBLOCK = 128        # blocks one program of `_sum_partials_kernel` adds per iteration
NUM_WARPS = 4
DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@functools.lru_cache(maxsize=64)
def _addresses(device: torch.device, pointers: Tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(pointers, dtype=torch.int64, device=device)


def _pointers(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' addresses as an int64 tensor on their device (what the kernels read back as pointers)."""
    return _addresses(tensors[0].device, tuple(t.data_ptr() for t in tensors))


class _Blocks:
    """The block map of tensors of ``sizes`` elements: program ``k`` takes elements ``start[k] .. + BLOCK`` of tensor
    ``tensor[k]``; tensor ``i``'s programs are ``first[i] .. first[i + 1]``."""

    def __init__(self, device: torch.device, sizes: Tuple[int, ...]):
        counts = [math.ceil(n / BLOCK) for n in sizes]
        self.count = sum(counts)
        first = [0]
        for c in counts:
            first.append(first[-1] + c)
        self.tensor = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], dtype=torch.int32,
                                   device=device)
        self.start = torch.tensor([k * BLOCK for c in counts for k in range(c)], dtype=torch.int64, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.first = torch.tensor(first, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=64)
def _blocks_of(device: torch.device, sizes: Tuple[int, ...]) -> _Blocks:
    return _Blocks(device, sizes)


def _blocks(tensors: Sequence[torch.Tensor]) -> _Blocks:
    return _blocks_of(tensors[0].device, tuple(t.numel() for t in tensors))


def _squares(blocks: _Blocks, partials: torch.Tensor, count: int) -> torch.Tensor:
    """Each tensor's two sums of squares ``[count, 2]`` (fp32) from its programs' partial sums."""
    squares = torch.empty((count, 2), dtype=torch.float32, device=partials.device)
    _sum_partials_kernel[(count,)](partials, blocks.first, squares, RBLOCK=RBLOCK, num_warps=NUM_WARPS)
    return squares


def lamb_moments(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 exp_avg_sqs: List[torch.Tensor], *, grad_scale: float, beta1: float, beta2: float, eps_hat: float,
                 step_size: float, weight_decay: float, lr: float, adapt: bool) -> Optional[torch.Tensor]:
    """LAMB's first pass: the moments advanced in place; with ``adapt``, returns ``[len(params), 2]``, each tensor's
    ``||w||^2`` and ``||u||^2`` (its shard's, for a DTensor's local tensors); without, the step is taken (ratio 1)
    and None is returned. ``eps_hat`` and ``step_size`` carry the bias corrections (`aiak.optim.lamb`)."""
    blocks = _blocks(params)
    partials = torch.empty((max(blocks.count, 1), 2), dtype=torch.float32, device=params[0].device)  # all written
    if blocks.count:
        _lamb_moments_kernel[(blocks.count,)](
            _pointers(params), _pointers(grads), _pointers(exp_avgs), _pointers(exp_avg_sqs), blocks.tensor,
            blocks.start, blocks.sizes, partials, float(grad_scale), float(beta1), 1.0 - beta1, float(beta2),
            1.0 - beta2, float(eps_hat), float(step_size), float(weight_decay), float(lr),
            PARAM=DTYPES[params[0].dtype], ADAPT=adapt, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return _squares(blocks, partials, len(params)) if adapt else None


def lamb_apply(params: List[torch.Tensor], exp_avgs: List[torch.Tensor], exp_avg_sqs: List[torch.Tensor],
               ratios: torch.Tensor, *, eps_hat: float, step_size: float, weight_decay: float, lr: float) -> None:
    """LAMB's second pass: ``w -= lr * ratio * u``, ``u`` computed again from ``w`` and the new moments."""
    blocks = _blocks(params)
    if blocks.count:
        _lamb_update_kernel[(blocks.count,)](
            _pointers(params), _pointers(exp_avgs), _pointers(exp_avg_sqs), blocks.tensor, blocks.start,
            blocks.sizes, ratios.to(torch.float32).contiguous(), float(eps_hat), float(step_size),
            float(weight_decay), float(lr), PARAM=DTYPES[params[0].dtype], BLOCK=BLOCK, num_warps=NUM_WARPS)


def lars_squares(params: List[torch.Tensor], grads: List[torch.Tensor]) -> torch.Tensor:
    """LARS's first pass: ``[len(params), 2]``, each tensor's ``||w||^2`` and ``||g||^2``."""
    blocks = _blocks(params)
    partials = torch.empty((max(blocks.count, 1), 2), dtype=torch.float32, device=params[0].device)  # all written
    if blocks.count:
        _lars_squares_kernel[(blocks.count,)](_pointers(params), _pointers(grads), blocks.tensor, blocks.start,
                                              blocks.sizes, partials, PARAM=DTYPES[params[0].dtype], BLOCK=BLOCK,
                                              num_warps=NUM_WARPS)
    return _squares(blocks, partials, len(params))


def lars_apply(params: List[torch.Tensor], grads: List[torch.Tensor], buffers: Optional[List[torch.Tensor]],
               ratios: Optional[torch.Tensor], *, lr: float, momentum: float, weight_decay: float,
               nesterov: bool) -> None:
    """LARS's second pass (`_lars_update_kernel`): ``ratios`` one per tensor, None for plain SGD momentum steps;
    ``buffers`` the fp32 momentum buffers, None without momentum."""
    blocks = _blocks(params)
    if not blocks.count:
        return
    dummy = _pointers(params)   # an address table the kernel does not read where MOMENTUM or ADAPT is off
    _lars_update_kernel[(blocks.count,)](
        _pointers(params), _pointers(grads), _pointers(buffers) if buffers is not None else dummy, blocks.tensor,
        blocks.start, blocks.sizes, ratios.to(torch.float32).contiguous() if ratios is not None else blocks.sizes,
        float(lr), float(momentum), float(weight_decay), PARAM=DTYPES[params[0].dtype],
        MOMENTUM=buffers is not None, NESTEROV=nesterov, ADAPT=ratios is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
