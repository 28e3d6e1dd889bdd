"""The loss of a linear head without its logits: ``cross_entropy(linear(hidden, weight, bias), target)``.

A language model's last step materialises ``logits = hidden @ weight.T`` for every token (tokens x vocabulary,
upcast to fp32), then the cross-entropy, then a gradient of the same size: at 4096 tokens and a 128k
vocabulary, 6 GiB on this project's CPU for a head whose weight is 1 GiB. Computing the loss a slice of tokens
at a time never holds more than one slice's logits (Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models", ICLR 2025, the same idea taken to a kernel; Liger-Kernel's fused linear cross-entropy).

Implementations, one `autograd.Function` and torch's own op:

* ``"chunked"`` (`ChunkedLinearCrossEntropy`): slices of tokens; each slice's logits are made in the hidden
  states' dtype (as the head makes them), transformed as the model does (``logit_scale``, then ``softcap``:
  Gemma-2's ``tanh(z / cap) * cap``), upcast to fp32 for the softmax (as Hugging Face's loss does), and
  their gradient ``softmax - target`` (label smoothing spread over the classes) is taken at once. Where the
  upstream gradient cannot change the rounding, the gradients of the hidden states, weight and bias are made
  in the forward pass and only scaled in backward (one matmul per slice saved); in fp16, whose gradients would
  underflow before a loss scale reaches them, and with ``reduction="none"``, backward recomputes each slice's
  logits and uses the upstream gradient as plain autograd would.
* ``"torch"``: `torch.nn.functional.linear_cross_entropy` with `torch.nn.LinearCrossEntropyOptions` (torch
  2.11 and later), fp32 only and without logit transforms: in bf16 it returns its loss in bf16 (0.27 off at a
  loss of 10.9 against the fp32 upcast Hugging Face models report).
* ``"plain"``: the unfused formula, the reference of the tests.

``"auto"`` takes ``"chunked"``. On this project's 2-core CPU (`benchmarks/linear_cross_entropy.py`, vocabulary
128256, hidden 2048, 4096 tokens, 4 alternating rounds) the chunked head held 0.21x plain's peak in fp32 at 0.99x
its time (0.94-1.06x) and 0.15x in bf16 at 0.87x (0.83-1.24x); torch's op held 0.18x in fp32 at 1.15x (1.09-1.19x).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["linear_cross_entropy", "ChunkedLinearCrossEntropy", "IMPLEMENTATIONS", "chunk_tokens_for"]

IMPLEMENTATIONS = ("auto", "chunked", "torch", "plain")
REDUCTIONS = ("mean", "sum", "none")
# A slice's fp32 logits (tokens x vocabulary) are kept near this size. Shorter slices hold less but their matmuls
# run slower on a CPU: at a 50k vocabulary, hidden 1024 and 4096 tokens on this project's 2-core CPU, the bf16 head
# took 1.01x plain's time with 256 MiB slices (1335 tokens) against 1.31x with 100 MiB ones (512 tokens).
CHUNK_BYTES = 256 * 2 ** 20
# Nor fewer tokens than this in a slice: each slice adds its product into the whole weight gradient, so at a large
# vocabulary the slices' count sets the time. At Gemma's 256000 classes, hidden 2048, 2048 tokens (fp32), 256-token
# slices took 1.28x plain's time (1.20-1.38x) against 1.03x (0.96-1.07x) with 512-token ones, at 0.38x and 0.42x
# plain's peak.
MIN_SLICE_TOKENS = 512


def chunk_tokens_for(vocab: int, chunk_bytes: int = CHUNK_BYTES, min_tokens: int = MIN_SLICE_TOKENS) -> int:
    """Tokens per slice so that one slice's fp32 logits take about ``chunk_bytes``, and at least ``min_tokens``."""
    return max(min_tokens, chunk_bytes // (4 * max(vocab, 1)))


def _transform(z: torch.Tensor, logit_scale: Optional[float], softcap: Optional[float]) -> torch.Tensor:
    """What the model does to its logits after the head, in their dtype: Cohere's ``* logit_scale`` (Granite's
    ``/ logits_scaling`` as its inverse), then Gemma-2's soft-capping ``tanh(z / cap) * cap``."""
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _transform_grad(z: torch.Tensor, grad: torch.Tensor, logit_scale: Optional[float],
                    softcap: Optional[float]) -> torch.Tensor:
    """The gradient through `_transform` at the head's output ``z`` (fp32): ``grad`` is the transformed
    logits' gradient."""
    if softcap is not None:
        scaled = z.float() * logit_scale if logit_scale is not None else z.float()
        grad = grad * (1 - torch.tanh(scaled / softcap) ** 2)
    if logit_scale is not None:
        grad = grad * logit_scale
    return grad


def _slice_loss_and_grad(h, weight, bias, target, ignore_index: int, label_smoothing: float, logit_scale, softcap,
                         grad_scale):
    """One slice: the per-token losses (fp32, 0 where ignored) and, unless ``grad_scale`` is None, the gradient
    of their sum times ``grad_scale`` (a number, or a per-token column) with respect to the head's output,
    fp32. The softmax is made in place of the slice's fp32 logits: five passes over them in all."""
    z = F.linear(h, weight, bias)
    logits = _transform(z, logit_scale, softcap).float()
    vocab = logits.shape[-1]
    keep = target != ignore_index
    safe = torch.where(keep, target, torch.zeros_like(target)).unsqueeze(1)
    picked = logits.gather(1, safe).squeeze(1)
    total = logits.sum(dim=-1) if label_smoothing else None
    top = logits.amax(dim=-1, keepdim=True)
    exps = logits.sub_(top).exp_()                                       # in place of the logits
    sums = exps.sum(dim=-1, keepdim=True)
    lse = (top + sums.log()).squeeze(1)
    losses = lse - (1 - label_smoothing) * picked
    if label_smoothing:
        losses = losses - label_smoothing / vocab * total
    losses = losses.masked_fill(~keep, 0.0)
    if grad_scale is None:
        return losses, None
    grad = exps.mul_(grad_scale / sums)                                  # softmax x grad_scale, in place
    scale_column = torch.as_tensor(grad_scale, dtype=torch.float32, device=grad.device).expand(len(target), 1)
    grad.scatter_add_(1, safe, -(1 - label_smoothing) * scale_column)
    if label_smoothing:
        grad.sub_(label_smoothing / vocab * scale_column)
    grad.masked_fill_(~keep.unsqueeze(1), 0.0)
    return losses, _transform_grad(z, grad, logit_scale, softcap)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(transform(linear(hidden, weight, bias)).float(), target)`` a slice of tokens at a time.

    ``hidden`` ``[N, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None, ``target`` ``[N]`` (long),
    ``divisor``: what the summed loss is divided by (a 0-d tensor: the tokens kept, or the items counted), or
    None for ``reduction`` ``"sum"`` and ``"none"``. The weight's gradient is summed over the slices in the
    weight's dtype, each slice's product accumulated in fp32 by the matmul (``addmm_``): no fp32 copy of the
    weight, and in bf16 and fp16 within the tests' bound of plain's error even at 64 slices."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, divisor, reduction, ignore_index, label_smoothing,
                logit_scale, softcap, chunk):
        ctx.options = (reduction, ignore_index, label_smoothing, logit_scale, softcap, chunk)
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        ctx.precomputed = reduction != "none" and hidden.dtype != torch.float16 and any(needs)
        grads = _zero_grads(hidden, weight, bias, needs) if ctx.precomputed else None
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        scale = None if divisor is None else 1.0 / divisor.to(torch.float32)
        grad_scale = (1.0 if scale is None else scale) if ctx.precomputed else None
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            losses[start:end], grad_z = _slice_loss_and_grad(h, weight, bias, target[start:end], ignore_index,
                                                             label_smoothing, logit_scale, softcap, grad_scale)
            if ctx.precomputed:
                _accumulate(grads, grad_z.to(hidden.dtype), h, weight, start, end)
            del grad_z      # before the next slice's logits are made: one slice's at a time, not two
        ctx.consumed = False
        if ctx.precomputed:
            ctx.save_for_backward(*grads)
            ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, scale)
        if reduction == "none":
            return losses
        total = losses.sum()
        return total * scale if scale is not None else total

    @staticmethod
    def backward(ctx, grad_output):
        reduction, ignore_index, label_smoothing, logit_scale, softcap, chunk = ctx.options
        if ctx.precomputed:    # the sums made in the forward pass times the upstream gradient
            if ctx.consumed:
                raise RuntimeError("linear_cross_entropy: a second backward through the same loss; its gradients "
                                   "were made in the forward pass and handed out by the first. Compute the loss "
                                   "again, or use implementation='plain' for a graph kept with retain_graph=True")
            ctx.consumed = True
            g = grad_output.to(torch.float32)
            out = [None if t is None else t.mul_(g) if t.dtype == dtype else    # in place: no second copy
                   torch.mul(t, g, out=torch.empty(t.shape, dtype=dtype, device=t.device))
                   for t, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
            return (*out, None, None, None, None, None, None, None, None)
        hidden, weight, bias, target, scale = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        grads = _zero_grads(hidden, weight, bias, needs)
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            upstream = grad_output[start:end].float().unsqueeze(1) if reduction == "none" else grad_output.float()
            _, grad_z = _slice_loss_and_grad(h, weight, bias, target[start:end], ignore_index, label_smoothing,
                                             logit_scale, softcap, upstream * scale if scale is not None else upstream)
            _accumulate(grads, grad_z.to(hidden.dtype), h, weight, start, end)
            del grad_z
        return (*_finish(grads, weight, bias), None, None, None, None, None, None, None, None)


def _zero_grads(hidden, weight, bias, needs):
    return (torch.empty_like(hidden) if needs[0] else None,
            torch.zeros_like(weight) if needs[1] else None,
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and needs[2]
            else None)


def _accumulate(grads, grad_z, h, weight, start: int, end: int) -> None:
    """Add one slice's gradient ``grad_z`` (the head's output, in the hidden dtype) into ``grads``."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        torch.mm(grad_z, weight, out=grad_hidden[start:end])
    if grad_weight is not None:     # in the weight's dtype, each slice's product summed in fp32 by the matmul
        grad_weight.addmm_(grad_z.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
    if grad_bias is not None:
        grad_bias.add_(grad_z.sum(0, dtype=torch.float32))


def _finish(grads, weight, bias):
    grad_hidden, grad_weight, grad_bias = grads
    return (grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype))


def _check(hidden, weight, target, bias, reduction, implementation, label_smoothing) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}; valid choices: {list(REDUCTIONS)}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"linear_cross_entropy: implementation={implementation!r}; valid choices: "
                         f"{list(IMPLEMENTATIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do "
                         "not make a linear head (weight must be [classes, hidden.shape[-1]])")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_cross_entropy: target {tuple(target.shape)} must have hidden's shape without its "
                         f"last dimension, {tuple(hidden.shape[:-1])}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"linear_cross_entropy: target must hold class indices (int64), got {target.dtype}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_cross_entropy: bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100, *,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         num_items: Union[None, int, torch.Tensor] = None, logit_scale: Optional[float] = None,
                         softcap: Optional[float] = None, implementation: str = "auto",
                         chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """``F.cross_entropy(transform(F.linear(hidden, weight, bias)).float(), target)`` without the logits.

    Args:
        hidden: ``[..., H]`` the head's input (any float dtype; the logits are made in it, as the head would).
        weight: ``[V, H]`` the head's weight (a tied embedding's weight: its gradient lands there).
        target: ``hidden.shape[:-1]`` class indices; ``ignore_index`` ones add nothing.
        bias: ``[V]`` or None.
        ignore_index: the target value that is skipped (Hugging Face: -100).
        reduction: ``"mean"`` (over the tokens kept, or over ``num_items``), ``"sum"`` or ``"none"`` (fp32 per
            token, 0 where ignored).
        label_smoothing: as `torch.nn.functional.cross_entropy`'s.
        num_items: with ``"mean"``, divide the sum by this instead (Hugging Face's ``num_items_in_batch``: the
            tokens of a whole accumulation window).
        logit_scale: multiply the logits by it before the loss (Cohere; Granite's ``1 / logits_scaling``).
        softcap: soft-cap the logits, ``tanh(z / softcap) * softcap`` (Gemma-2, Gemma-3).
        implementation: ``"auto"``, ``"chunked"``, ``"torch"`` or ``"plain"`` (the module docstring compares them).
        chunk_tokens: tokens per slice (default: `chunk_tokens_for` the vocabulary).

    Returns:
        The loss in fp32: a scalar, or ``hidden.shape[:-1]`` with ``reduction="none"``.

    Raises:
        ValueError: for shapes that do not make a linear head, or an unknown ``reduction`` or ``implementation``.
        TypeError: for a target that is not class indices.
    """
    _check(hidden, weight, target, bias, reduction, implementation, label_smoothing)
    shape = target.shape
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
    divisor = None
    if reduction == "mean":
        divisor = (torch.as_tensor(num_items, device=hidden.device) if num_items is not None
                   else (target != ignore_index).sum())
    chosen = _choose(implementation, hidden, logit_scale, softcap, label_smoothing)
    if chosen == "plain":
        z = _transform(F.linear(hidden, weight, bias), logit_scale, softcap).float()
        loss = F.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="none" if reduction == "none" else "sum")
    elif chosen == "torch":
        loss = F.linear_cross_entropy(hidden, weight, target, linear_bias=bias, ignore_index=ignore_index,
                                      label_smoothing=label_smoothing,
                                      reduction="none" if reduction == "none" else "sum",
                                      options=torch.nn.LinearCrossEntropyOptions())
    else:
        chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
        return _shaped(ChunkedLinearCrossEntropy.apply(hidden, weight, bias, target, divisor, reduction, ignore_index,
                                                       label_smoothing, logit_scale, softcap, chunk), shape, reduction)
    if divisor is not None:
        loss = loss / divisor
    return _shaped(loss, shape, reduction)


def _shaped(loss: torch.Tensor, shape: torch.Size, reduction: str) -> torch.Tensor:
    return loss.reshape(shape) if reduction == "none" else loss


def _choose(implementation: str, hidden: torch.Tensor, logit_scale, softcap, label_smoothing: float) -> str:
    if implementation == "torch":
        problems = _torch_op_refuses(hidden, logit_scale, softcap, label_smoothing)
        if problems:
            raise ValueError(f"linear_cross_entropy: implementation='torch' cannot compute this: {problems}; use "
                             "'chunked'")
        return "torch"
    return "chunked" if implementation == "auto" else implementation


def _torch_op_refuses(hidden: torch.Tensor, logit_scale, softcap, label_smoothing: float) -> Optional[str]:
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (torch 2.11 and later)"
    if hidden.dtype != torch.float32:
        return f"its loss is returned in {hidden.dtype}, not the fp32 Hugging Face models report"
    if logit_scale is not None or softcap is not None:
        return "it has no logit scale or soft-capping"
    if label_smoothing:
        return "with label smoothing it runs its unchunked reference, logits and all"
    return None
