"""LAMB: layer-wise adaptive moments for large-batch training.

Follows Algorithm 2 of You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes" (ICLR 2020, arXiv:1904.00962), with phi the identity::

    m_t = beta1 * m + (1 - beta1) * g                 v_t = beta2 * v + (1 - beta2) * g^2
    r_t = (m_t / (1 - beta1^t)) / (sqrt(v_t / (1 - beta2^t)) + eps)
    u_t = r_t + weight_decay * w                       (decay added to the update, decoupled from g)
    w  -= lr * (||w|| / ||u_t||) * u_t                 (trust ratio 1 when either norm is 0)

The trust ratio is applied to *every* parameter of a group whose ``adapt`` is true, as in the paper.
apex's ``FusedLAMB`` instead skips it for parameters with zero weight decay; here exclusion is explicit
(``adapt=False`` per group, see `aiak.optim.param_groups.layerwise_param_groups`). Options:
``trust_clip`` caps the ratio, ``max_grad_norm`` rescales all gradients by one global factor before the
moments (apex's ``max_grad_norm``), ``bias_correction=False`` drops the ``1 - beta^t`` terms.

The class only gathers parameters and state; `lamb` runs the math: on CUDA in two multi-tensor Triton passes
(`aiak.optim._triton.layerwise`, apex's FusedLAMB shape), elsewhere in a single-tensor loop or the
bucketed multi-tensor path of `aiak.optim._multi_tensor` (the default). There, the moments and
``u_t`` of a bucket come from one pass of torch's fused Adam kernel (the one ``Adam(fused=True)`` runs,
on CPU and CUDA; see `_moments_and_update`), the two norms per tensor are taken while the bucket
is in cache, and one more pass applies the step: 7 x 4 bytes of memory traffic per fp32 parameter, the
minimum. Moments are fp32 and the update is computed in fp32 for fp16/bf16 parameters.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

from aiak.optim._multi_tensor import (LayerwiseOptimizer, PlanCache, add_scaled_, cached_plan, check_betas,
                                      check_range, clip_coefficient, default_bucket_elems, group_by_device_dtype_step,
                                      math_dtype, norms, working_copies, write_back)
from aiak.optim.sharded import full_norms, local, squares

__all__ = ["Lamb", "lamb"]


class Lamb(LayerwiseOptimizer):
    """LAMB (You et al. 2019), exact to the paper's Algorithm 2.

    Adam's update scaled per tensor by the trust ratio `||w|| / ||u||`, so that a large batch's learning rate does
    not blow up layers with small weights ("Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
    arXiv:1904.00962). A `torch.optim.Optimizer`: it gathers parameters and state, and the functional `lamb` runs
    the math.

    Args:
        params: parameters or parameter groups. A group may set `adapt=False` to take plain Adam steps
            (trust ratio 1), which is how biases and normalization weights are usually excluded.
        lr: learning rate; default 1e-3, timm's (timm 1.0.31 `timm/optim/lamb.py`: `lr: float = 1e-3`).
        betas: the decay rates of the first and second moments.
        eps: added to `sqrt(v_hat)`.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        bias_correction: divide the moments by `1 - beta^t` (the paper does).
        adapt: default of the per-group trust-ratio switch.
        trust_clip: if set, the trust ratio is capped at this value.
        max_grad_norm: if set, all gradients are scaled by `min(1, max_grad_norm / ||g||_global)` first.
        foreach: multi-tensor path (default) or the per-tensor loop.
        bucket_elems: elements per multi-tensor bucket; `None` picks a cache-sized bucket on CPU and one
            bucket on GPU, `0` forces one bucket.
        fused: the Triton kernels (`aiak.optim._triton.layerwise`: the moments and the norms in one multi-tensor
            launch, the update in a second, as apex's FusedLAMB): `None` (default) where they run (CUDA
            parameters, triton installed) and a group does not ask for the loop (`foreach=False`), `True` there
            and in every group but warns once where they cannot, `False` never.
            Elsewhere the torch paths step (`foreach`).

    Raises:
        ValueError: a hyper-parameter out of its range (`lr`, `eps`, `weight_decay` < 0, `betas` not a pair in
            [0, 1), `trust_clip` or `max_grad_norm` <= 0, a bad `bucket_elems`), naming it and the valid interval.
    """

    _fp32_state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, *, bias_correction: bool = True, adapt: bool = True,
                 trust_clip: Optional[float] = None, max_grad_norm: Optional[float] = None,
                 foreach: Optional[bool] = None, bucket_elems: Optional[int] = None, fused: Optional[bool] = None):
        if max_grad_norm is not None:
            check_range("max_grad_norm", max_grad_norm, 0.0, low_open=True)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        adapt=adapt, trust_clip=trust_clip, foreach=foreach)
        super().__init__(params, defaults, bucket_elems, fused)
        self.max_grad_norm = max_grad_norm

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_group(group)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["exp_avg"] = torch.zeros_like(p, dtype=math_dtype(p.dtype), memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=math_dtype(p.dtype), memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._begin_step(closure)
        grad_scale = clip_coefficient(self.param_groups, self.max_grad_norm)
        if self._sharded():
            self._step_on_shards(grad_scale)
            return loss
        bucket_elems, plans = self._bucketing()
        for group in self.param_groups:
            params, grads, steps, state = self._gather(group, ("exp_avg", "exp_avg_sq"))
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lamb(params, grads, state["exp_avg"], state["exp_avg_sq"], steps, lr=group["lr"], beta1=beta1,
                 beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                 bias_correction=group["bias_correction"], adapt=group["adapt"], trust_clip=group["trust_clip"],
                 grad_scale=grad_scale, foreach=group["foreach"] is not False, bucket_elems=bucket_elems,
                 plans=plans, fused=self._runs_triton(group, params, grads, state["exp_avg"],
                                                      state["exp_avg_sq"]))
        if plans is not None:
            plans.prune()
        return loss

    def _step_on_shards(self, grad_scale: float) -> None:
        """DTensor parameters (`aiak.optim.sharded`): every group's moments on the local shards with the squared norms
        of their weights and updates (the Triton kernels' first pass, or the loop or foreach forms as the group's
        ``foreach`` says; buckets do not apply), then the full tensors' norms of every adapting group in one
        collective, then the updates (apex's FusedLAMB's two passes)."""
        passes = []
        for group in self.param_groups:
            params, grads, steps, state = self._gather(group, ("exp_avg", "exp_avg_sq"))
            if not params:
                continue
            tensors = [[local(t) for t in ts] for ts in (params, grads, state["exp_avg"], state["exp_avg_sq"])]
            beta1, beta2 = group["betas"]
            kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      bias_correction=group["bias_correction"], adapt=group["adapt"], grad_scale=grad_scale)
            if self._runs_triton(group, *tensors):
                squared, second = _triton_passes(*tensors, steps, **kw)
            else:
                squared, second = _torch_passes(*tensors, steps, foreach=group["foreach"] is not False, **kw)
            if squared is not None:
                passes.append((group, params, squared, second))
        if passes:
            for (group, _, _, second), (w_norms, u_norms) in zip(passes, full_norms([p[1:3] for p in passes])):
                second(trust_ratio(w_norms, u_norms, group["trust_clip"]))

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["max_grad_norm"] = self.max_grad_norm
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.max_grad_norm = state_dict.pop("max_grad_norm", self.max_grad_norm)
        super().load_state_dict(state_dict)


def _check_group(group: dict) -> None:
    """Validate a group's own overrides (``Optimizer`` fills the rest from the defaults)."""
    check_range("lr", group["lr"], 0.0)
    group["betas"] = check_betas(group["betas"])
    check_range("eps", group["eps"], 0.0)
    check_range("weight_decay", group["weight_decay"], 0.0)
    if group["trust_clip"] is not None:
        check_range("trust_clip", group["trust_clip"], 0.0, low_open=True)


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, trust_clip: Optional[float]) -> torch.Tensor:
    """``||w|| / ||u||`` elementwise over stacked norms, 1 where either is 0, capped at ``trust_clip``."""
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return ratio if trust_clip is None else ratio.clamp(max=trust_clip)


def lamb(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
         exp_avg_sqs: List[torch.Tensor], steps: List[int], *, lr: float, beta1: float, beta2: float, eps: float,
         weight_decay: float, bias_correction: bool = True, adapt: bool = True, trust_clip: Optional[float] = None,
         grad_scale: float = 1.0, foreach: bool = True, bucket_elems: Optional[int] = None,
         plans: Optional[PlanCache] = None, fused: bool = False) -> None:
    """One LAMB step over lists of tensors (``steps`` already counts this step). Updates in place.

    ``plans`` (multi-tensor path): a `PlanCache` owned by the caller that
    keeps bucket views and scratch memory between calls; without it they are rebuilt each call.
    ``fused``: the Triton kernels step (the tensors must fit them: `aiak.optim._multi_tensor.triton_unfit`).
    """
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
              adapt=adapt, trust_clip=trust_clip, grad_scale=grad_scale)
    if fused:
        _triton_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, **kw)
    elif foreach:
        _multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, bucket_elems=bucket_elems,
                           plans=plans, **kw)
    else:
        _single_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, **kw)


def _step_scalars(step: int, beta1: float, beta2: float, eps: float, bias_correction: bool) -> Tuple[float, float]:
    """``(eps_hat, step_size)`` with ``m_hat / (sqrt(v_hat) + eps) == step_size * m / (sqrt(v) + eps_hat)``."""
    if not bias_correction:
        return eps, 1.0
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    return eps * bc2_sqrt, bc2_sqrt / bc1


def _triton_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, *, trust_clip, **kw):
    """The Triton kernels' step (`_triton_passes`), the trust ratios of this process's tensors between the passes."""
    squared, second = _triton_passes(params, grads, exp_avgs, exp_avg_sqs, steps, **kw)
    if squared is not None:
        norms = squared.sqrt()
        second(trust_ratio(norms[:, 0], norms[:, 1], trust_clip))


def _triton_passes(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                   bias_correction, adapt, grad_scale) -> Tuple[Optional[torch.Tensor], Callable]:
    """The Triton kernels' first pass over ``params`` (`aiak.optim._triton.layerwise`, per dtype and step count): the
    moments advanced in place. Returns each weight's and update's squared norm (``[len(params), 2]``) and the second
    pass, to call with the trust ratios; without ``adapt`` the first pass takes the whole step: ``(None, None)``."""
    from aiak.optim._triton import layerwise

    parts = []
    groups = group_by_device_dtype_step(params, steps)
    whole = len(groups) == 1   # (as a rule: one dtype and step count; no index to scatter and gather with)
    squared = torch.empty((len(params), 2), dtype=torch.float32, device=params[0].device) if adapt else None
    for (_, _, step), idx in groups.items():
        p, m, v = [params[i] for i in idx], [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        eps_hat, step_size = _step_scalars(step, beta1, beta2, eps, bias_correction)
        scalars = dict(eps_hat=eps_hat, step_size=step_size, weight_decay=weight_decay, lr=lr)
        part = layerwise.lamb_moments(p, [grads[i] for i in idx], m, v, grad_scale=grad_scale, beta1=beta1,
                                      beta2=beta2, adapt=adapt, **scalars)
        index = None if whole else torch.tensor(idx, device=params[0].device)
        if adapt:
            squared = part if whole else squared.index_copy_(0, index, part)
        parts.append((index, p, m, v, scalars))

    def second(ratios: torch.Tensor) -> None:
        for index, p, m, v, scalars in parts:
            layerwise.lamb_apply(p, m, v, ratios if index is None else ratios.index_select(0, index), **scalars)

    return (squared, second) if adapt else (None, None)


def _torch_passes(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, adapt, foreach, **kw
                  ) -> Tuple[Optional[torch.Tensor], Callable]:
    """`_triton_passes` in torch ops (`lamb_updates`, the loop or foreach form), for DTensors' local shards."""
    w, u = lamb_updates(params, grads, exp_avgs, exp_avg_sqs, steps, foreach=foreach, **kw)
    if not adapt:
        torch._foreach_add_(w, u, alpha=-lr)
        write_back(params, w)
        return None, None

    def second(ratios: torch.Tensor) -> None:
        for wi, ui, r in zip(w, u, ratios.unbind()):
            wi.addcmul_(ui, r, value=-lr)
        write_back(params, w)

    return torch.stack([squares(w), squares(u)], dim=1), second


def _single_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                        bias_correction, adapt, trust_clip, grad_scale):
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        w = p.to(math_dtype(p.dtype))
        g = g.to(w.dtype)
        if grad_scale != 1.0:
            g = g * grad_scale
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        eps_hat, step_size = _step_scalars(step, beta1, beta2, eps, bias_correction)
        update = _direction(w, m, v, eps_hat, step_size, weight_decay)
        if adapt:
            ratio = trust_ratio(torch.linalg.vector_norm(w), torch.linalg.vector_norm(update), trust_clip)
            w.addcmul_(update, ratio, value=-lr)
        else:
            w.add_(update, alpha=-lr)
        if w is not p:
            p.copy_(w)


def _direction(w, m, v, eps_hat, step_size, weight_decay):
    """``u = step_size * m / (sqrt(v) + eps_hat) + weight_decay * w`` (one tensor)."""
    denom = v.sqrt().add_(eps_hat)
    if weight_decay:
        return torch.mul(w, weight_decay).addcdiv_(m, denom, value=step_size)
    return torch.div(m, denom).mul_(step_size)


def _foreach_direction(plan, k, w, m, v, eps_hat, step_size, weight_decay, out=None):
    """Bucket ``k``'s update as ``(scale, u')`` with ``u = scale * u'`` (`_direction` over lists).

    ``u' = w + (step_size / weight_decay) * m / denom`` is one ``addcdiv`` instead of a multiply and an
    ``addcdiv``; the factor ``weight_decay`` is carried as a scalar into the norm and the step. On CPU
    both temporaries are written with ``out=`` into the plan's scratch (no copies, no allocation), or
    the update into ``out`` when given.
    """
    scale, value = (weight_decay, step_size / weight_decay) if weight_decay else (step_size, 1.0)
    if plan.cached_scratch:
        denom = plan.scratch(k, 0, v[0].dtype)
        update = plan.scratch(k, 1, m[0].dtype) if out is None else out
        for vi, di in zip(v, denom):
            torch.sqrt(vi, out=di)
        torch._foreach_add_(denom, eps_hat)
        if weight_decay:
            for wi, mi, di, ui in zip(w, m, denom, update):
                torch.addcdiv(wi, mi, di, value=value, out=ui)
        else:
            for mi, di, ui in zip(m, denom, update):
                torch.div(mi, di, out=ui)
        return scale, update
    denom = torch._foreach_sqrt(v)
    torch._foreach_add_(denom, eps_hat)
    if weight_decay:
        return scale, torch._foreach_addcdiv(w, m, denom, value)
    return scale, torch._foreach_div(m, denom)


def lamb_updates(params, grads, exp_avgs, exp_avg_sqs, steps, *, beta1, beta2, eps, weight_decay, bias_correction,
                 grad_scale=1.0, foreach=True):
    """The first of two passes: each tensor's moments advanced in place and its update ``u_t``, returned as
    ``(w, u)`` in ``params``' order, ``w`` the math-dtype weight (``params[i]`` itself in fp32, else a copy the
    second pass writes back). For norms taken elsewhere before the step (`aiak.optim.sharded`)."""
    ws: List[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
    us: List[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
    groups = group_by_device_dtype_step(params, steps).items() if foreach else \
        [((None, None, s), [i]) for i, s in enumerate(steps)]
    for (_, _, step), idx in groups:
        w = [params[i].to(math_dtype(params[i].dtype)) for i in idx]
        g = [grads[i].to(w[0].dtype) for i in idx]
        if grad_scale != 1.0:
            g = torch._foreach_mul(g, grad_scale)
        m, v = [exp_avgs[i] for i in idx], [exp_avg_sqs[i] for i in idx]
        torch._foreach_lerp_(m, g, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1.0 - beta2)
        eps_hat, step_size = _step_scalars(step, beta1, beta2, eps, bias_correction)
        for i, wi, mi, vi in zip(idx, w, m, v):
            ws[i], us[i] = wi, _direction(wi, mi, vi, eps_hat, step_size, weight_decay)
    return ws, us


def _fused_adam_step(device: torch.device, step: int, bias_correction: bool) -> Optional[torch.Tensor]:
    """The step count as the 0-dim fp32 tensor torch's fused Adam kernel reads (``Adam(fused=True)``'s, on
    CPU and CUDA), or ``None`` where that kernel cannot serve: no bias correction (it always applies
    it), another device, a torch without it, or under ``torch.compile`` (its functionalization refuses the
    in-place kernel; the foreach form is traced instead and the compiler fuses it)."""
    if (not bias_correction or device.type not in ("cpu", "cuda") or not hasattr(torch, "_fused_adam_")
            or torch.compiler.is_compiling()):
        return None
    return torch.full((), float(step), dtype=torch.float32, device=device)


def _moments_and_update(plan, k, w, g, m, v, fused_step, *, beta1, beta2, eps, weight_decay, bias_correction,
                        step, out=None):
    """Advance bucket ``k``'s moments in place and return its update as ``(scale, u')``, ``u = scale * u'``.

    Fast path, one pass over ``g, m, v``: torch's fused Adam kernel run on a scratch tensor that holds
    ``weight_decay * w``. An Adam step with ``lr = -1`` and no decay of its own adds ``r_t`` (the
    bias-corrected ``m_hat / (sqrt(v_hat) + eps)``) to it, which leaves exactly ``u_t = r_t + weight_decay * w``
    and the new moments. It needs each tensor, its gradient and state in one dense layout
    (`fusable`); otherwise, or without ``fused_step``, the
    same maths runs as foreach ops (four more passes).
    """
    if fused_step is not None and plan.fusable(k, g):
        if out is None and not plan.cached_scratch:
            u = torch._foreach_mul(w, weight_decay) if weight_decay else [torch.zeros_like(t) for t in w]
        else:
            u = plan.scratch(k, 1, m[0].dtype) if out is None else out
            if weight_decay:
                for wi, ui in zip(w, u):
                    torch.mul(wi, weight_decay, out=ui)
            else:
                torch._foreach_zero_(u)
        torch._fused_adam_(u, g, m, v, [], [fused_step] * len(u), lr=-1.0, beta1=beta1, beta2=beta2,
                           weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)
        return 1.0, u
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1.0 - beta2)
    eps_hat, step_size = _step_scalars(step, beta1, beta2, eps, bias_correction)
    return _foreach_direction(plan, k, w, m, v, eps_hat, step_size, weight_decay, out=out)


def _multi_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                       bias_correction, adapt, trust_clip, grad_scale, bucket_elems, plans=None):
    for (device, _, step), idx in group_by_device_dtype_step(params, steps).items():
        G = [grads[i] for i in idx]
        size = default_bucket_elems(device) if bucket_elems is None else (bucket_elems or None)
        plan = cached_plan(plans, [[params[i] for i in idx], [exp_avgs[i] for i in idx],
                                   [exp_avg_sqs[i] for i in idx]], size)
        fused_step = _fused_adam_step(device, step, bias_correction)
        moments = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                       bias_correction=bias_correction, step=step)
        piece_norms: List[torch.Tensor] = []
        for k, (bucket, (p, m, v)) in enumerate(zip(plan.buckets, plan.views)):
            w, g = working_copies(plan, k, p, plan.take(k, G), grad_scale)
            if adapt and plan.cut[bucket[0][0]]:
                # A piece of a cut tensor: keep its update until the whole tensor's norms are known, then
                # (right after the last piece, while the updates are still in cache) apply the ratio.
                scale, update = _moments_and_update(plan, k, w, g, m, v, fused_step, **moments,
                                                    out=plan.whole_tensor_scratch(k, m[0].dtype))
                piece_norms.append(norms([w[0], update[0]]))
                if plan.is_last_piece(k):
                    w_norm, u_norm = torch.stack(piece_norms).square().sum(0).sqrt().unbind()
                    piece_norms = []
                    ratio = trust_ratio(w_norm, u_norm * scale, trust_clip)
                    for kk in plan.pieces_of[bucket[0][0]]:
                        p_piece = plan.views[kk][0]
                        w_piece, _ = working_copies(plan, kk, p_piece, None, 1.0)
                        add_scaled_(w_piece, plan.whole_tensor_scratch(kk, m[0].dtype), ratio.reshape(1),
                                    -lr * scale)
                        write_back(p_piece, w_piece)
                continue
            scale, update = _moments_and_update(plan, k, w, g, m, v, fused_step, **moments)
            if adapt:
                ratios = trust_ratio(norms(w), norms(update) * scale, trust_clip)
                add_scaled_(w, update, ratios, -lr * scale)
            else:
                torch._foreach_add_(w, update, alpha=-lr * scale)
            write_back(p, w)
