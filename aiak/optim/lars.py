"""LARS: layer-wise adaptive rate scaling for large-batch SGD.

Follows Algorithm 1 of You, Gitman and Ginsburg, "Large Batch Training of Convolutional Networks"
(arXiv:1708.03888), with the optional clipping of NVIDIA's LARC (apex ``apex.parallel.LARC``)::

    local = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)   (1 when a norm is 0)
    local = min(local / lr, 1)                                                   (clip=True, LARC)
    d     = local * (g + weight_decay * w)
    buf   = momentum * buf + d                                                   (buf starts at 0)
    w    -= lr * (d + momentum * buf if nesterov else buf)

The global learning rate multiplies the momentum buffer on the way out, as in ``torch.optim.SGD`` and
LARC; the paper folds it into ``buf``, which is the same update while ``lr`` is constant. Groups with
``adapt=False`` (biases, normalization weights; see `aiak.optim.param_groups`) take plain SGD
momentum steps (``local = 1``).

The class only gathers parameters and state; `lars` runs the math: on CUDA in two multi-tensor Triton passes
(`aiak.optim._triton.layerwise`), elsewhere in a single-tensor loop or the bucketed multi-tensor
(``torch._foreach_*``) path of `aiak.optim._multi_tensor` (the default). The
momentum buffer is fp32 and the update is computed in fp32 for fp16/bf16 parameters.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from aiak.optim._multi_tensor import (LayerwiseOptimizer, PlanCache, add_scaled_, cached_plan, check_range,
                                      default_bucket_elems, group_by_device_dtype_step, math_dtype, norms,
                                      per_tensor_scalars, working_copies, write_back)
from aiak.optim.sharded import full_norms, local, squares

__all__ = ["Lars", "lars"]


class Lars(LayerwiseOptimizer):
    """LARS (You et al. 2017), with LARC clipping and Nesterov momentum as options.

    SGD with momentum whose step is scaled per tensor by `trust_coefficient * ||w|| / ||g||`, so that very large
    batches train convolutional networks at a large learning rate ("Large Batch Training of Convolutional
    Networks", arXiv:1708.03888). A `torch.optim.Optimizer`: it gathers parameters and state, and the functional
    `lars` runs the math.

    Args:
        params: parameters or parameter groups; a group may set `adapt=False` for plain SGD momentum.
        lr: global learning rate; default 1.0, timm's (timm 1.0.31 `timm/optim/lars.py`: `lr=1.0`; with the
            trust coefficient 0.001 the layer-wise step is `0.001 * ||w||`-sized).
        momentum: heavy-ball momentum (0 disables the buffer).
        weight_decay: L2 decay added to the gradient (and to the trust-ratio denominator).
        trust_coefficient: the paper's eta.
        eps: guards the trust-ratio denominator.
        nesterov: Nesterov momentum (needs momentum > 0).
        clip: LARC clipping `min(local / lr, 1)`.
        adapt: default of the per-group layer-wise switch.
        foreach: multi-tensor path (default) or the per-tensor loop.
        bucket_elems: elements per multi-tensor bucket, as in [aiak.optim.Lamb][aiak.optim.lamb.Lamb].
        fused: the Triton kernels (the norms in one multi-tensor launch, the update in a second), as in
            [aiak.optim.Lamb][aiak.optim.lamb.Lamb].

    Raises:
        ValueError: a hyper-parameter out of its range (`lr`, `weight_decay`, `eps` < 0, `momentum` outside
            [0, 1), `trust_coefficient` <= 0, `nesterov` without momentum, a bad `bucket_elems`), naming it and the
            valid interval.
    """

    _fp32_state_keys = ("momentum_buffer",)

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8, *, nesterov: bool = False,
                 clip: bool = False, adapt: bool = True, foreach: Optional[bool] = None,
                 bucket_elems: Optional[int] = None, fused: Optional[bool] = None):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, clip=clip, adapt=adapt, foreach=foreach)
        super().__init__(params, defaults, bucket_elems, fused)

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_group(group)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        pass  # the momentum buffer is created in step(), where the group's momentum is known

    def _buffers(self, group: dict, params: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """The group's momentum buffers (made at the first step, fp32), or None without momentum."""
        if not group["momentum"]:
            return None
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=math_dtype(p.dtype),
                                                            memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        return buffers

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = self._begin_step(closure)
        if self._sharded():
            self._step_on_shards()
            return loss
        bucket_elems, plans = self._bucketing()
        for group in self.param_groups:
            params, grads, _, _ = self._gather(group, ())
            if not params:
                continue
            buffers = self._buffers(group, params)
            lars(params, grads, buffers, lr=group["lr"], momentum=group["momentum"],
                 weight_decay=group["weight_decay"], trust_coefficient=group["trust_coefficient"], eps=group["eps"],
                 nesterov=group["nesterov"], clip=group["clip"], adapt=group["adapt"],
                 foreach=group["foreach"] is not False, bucket_elems=bucket_elems, plans=plans,
                 fused=self._runs_triton(group, params, grads, buffers))
        if plans is not None:
            plans.prune()
        return loss


    def _step_on_shards(self) -> None:
        """DTensor parameters (`aiak.optim.sharded`): the squared norms of every adapting group's local weights and
        gradients (the Triton kernels' first pass, or torch's), the full tensors' norms in one collective, then each
        group's update on the local shards (the kernels, or the loop or foreach form as the group's ``foreach``
        says; buckets do not apply)."""
        passes = []
        for group in self.param_groups:
            params, grads, _, _ = self._gather(group, ())
            if not params:
                continue
            buffers = self._buffers(group, params)
            tensors = [[local(t) for t in params], [local(t) for t in grads],
                       [local(b) for b in buffers] if buffers is not None else None]
            kw = dict(lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
                      nesterov=group["nesterov"], adapt=group["adapt"])
            if self._runs_triton(group, *tensors):
                squared, second = _triton_passes(*tensors, **kw)
            else:
                squared, second = _torch_passes(*tensors, foreach=group["foreach"] is not False, **kw)
            if squared is not None:
                passes.append((group, params, squared, second))
        if passes:
            for (group, _, _, second), (w_norms, g_norms) in zip(passes, full_norms([p[1:3] for p in passes])):
                second(lars_trust_ratio(w_norms, g_norms, lr=group["lr"], trust_coefficient=group["trust_coefficient"],
                                        weight_decay=group["weight_decay"], eps=group["eps"], clip=group["clip"]))

def _check_group(group: dict) -> None:
    check_range("lr", group["lr"], 0.0)
    check_range("momentum", group["momentum"], 0.0, 1.0, high_open=True)
    check_range("weight_decay", group["weight_decay"], 0.0)
    check_range("trust_coefficient", group["trust_coefficient"], 0.0, low_open=True)
    check_range("eps", group["eps"], 0.0)
    if group["nesterov"] and not group["momentum"]:
        raise ValueError("nesterov=True needs momentum > 0")


def lars_trust_ratio(w_norm: torch.Tensor, g_norm: torch.Tensor, *, lr: float, trust_coefficient: float,
                     weight_decay: float, eps: float, clip: bool) -> torch.Tensor:
    """Local learning rate multiplier over stacked norms; 1 where either norm is 0."""
    local = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
    if clip:
        local = (local / lr).clamp(max=1.0) if lr > 0 else torch.ones_like(local)
    return torch.where((w_norm > 0) & (g_norm > 0), local, torch.ones_like(local))


def lars(params: List[torch.Tensor], grads: List[torch.Tensor], momentum_buffers: Optional[List[torch.Tensor]], *,
         lr: float, momentum: float, weight_decay: float, trust_coefficient: float, eps: float,
         nesterov: bool = False, clip: bool = False, adapt: bool = True, foreach: bool = True,
         bucket_elems: Optional[int] = None, plans: Optional[PlanCache] = None, fused: bool = False) -> None:
    """One LARS step over lists of tensors; ``momentum_buffers`` (fp32, zero at start) when momentum > 0.

    ``plans``, ``fused``: as in `aiak.optim.lamb.lamb`.
    """
    kw = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, adapt=adapt,
              ratio=dict(lr=lr, trust_coefficient=trust_coefficient, weight_decay=weight_decay, eps=eps, clip=clip))
    if fused:
        _triton_lars(params, grads, momentum_buffers, **kw)
    elif foreach:
        _multi_tensor_lars(params, grads, momentum_buffers, bucket_elems=bucket_elems, plans=plans, **kw)
    else:
        _single_tensor_lars(params, grads, momentum_buffers, **kw)


def _triton_lars(params, grads, momentum_buffers, *, ratio, **kw):
    """The Triton kernels' step (`_triton_passes`), the trust ratios of this process's tensors between the passes."""
    squared, second = _triton_passes(params, grads, momentum_buffers, **kw)
    if squared is not None:
        norms = squared.sqrt()
        second(lars_trust_ratio(norms[:, 0], norms[:, 1], **ratio))


def _triton_passes(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov, adapt
                   ) -> Tuple[Optional[torch.Tensor], Optional[Callable]]:
    """The Triton kernels' first pass over ``params`` (`aiak.optim._triton.layerwise`, per dtype). Returns each
    weight's and gradient's squared norm (``[len(params), 2]``) and the second pass, the update, to call with the
    trust ratios; without ``adapt`` it takes the update at once: ``(None, None)``."""
    from aiak.optim._triton import layerwise

    update = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    parts = []
    groups = group_by_device_dtype_step(params, [0] * len(params))
    whole = len(groups) == 1   # (as a rule: one dtype; no index to scatter and gather with)
    squared = torch.empty((len(params), 2), dtype=torch.float32, device=params[0].device) if adapt else None
    for _, idx in groups.items():
        p, g = [params[i] for i in idx], [grads[i] for i in idx]
        b = [momentum_buffers[i] for i in idx] if momentum_buffers is not None else None
        if not adapt:
            layerwise.lars_apply(p, g, b, None, **update)
            continue
        index = None if whole else torch.tensor(idx, device=params[0].device)
        part = layerwise.lars_squares(p, g)
        squared = part if whole else squared.index_copy_(0, index, part)
        parts.append((index, p, g, b))

    def second(ratios: torch.Tensor) -> None:
        for index, p, g, b in parts:
            layerwise.lars_apply(p, g, b, ratios if index is None else ratios.index_select(0, index), **update)

    return (squared, second) if adapt else (None, None)


def _torch_passes(params, grads, momentum_buffers, *, lr, momentum, weight_decay, nesterov, adapt, foreach
                  ) -> Tuple[Optional[torch.Tensor], Optional[Callable]]:
    """`_triton_passes` in torch ops (`_foreach_update`, over all tensors or one at a time), for DTensors' shards."""
    w = [p.to(math_dtype(p.dtype)) for p in params]
    g = [t.to(w[0].dtype) for t in grads]
    update = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)

    def second(ratios: Optional[torch.Tensor]) -> None:
        if foreach:
            _foreach_update(w, g, momentum_buffers, ratios, **update)
        else:
            for i in range(len(w)):
                buffer = momentum_buffers[i:i + 1] if momentum_buffers is not None else None
                _foreach_update(w[i:i + 1], g[i:i + 1], buffer, ratios[i:i + 1] if ratios is not None else None,
                                **update)
        write_back(params, w)

    if not adapt:
        second(None)
        return None, None
    return torch.stack([squares(w), squares(g)], dim=1), second


def _single_tensor_lars(params, grads, momentum_buffers, *, lr, momentum, weight_decay, ratio, nesterov, adapt):
    for i, (p, g) in enumerate(zip(params, grads)):
        w = p.to(math_dtype(p.dtype))
        g = g.to(w.dtype)
        d = g.add(w, alpha=weight_decay) if weight_decay else g
        if adapt:
            d = d * lars_trust_ratio(torch.linalg.vector_norm(w), torch.linalg.vector_norm(g), **ratio)
        if momentum_buffers is not None:
            buf = momentum_buffers[i].mul_(momentum).add_(d)
            d = d.add(buf, alpha=momentum) if nesterov else buf
        w.add_(d, alpha=-lr)
        if w is not p:
            p.copy_(w)


def _foreach_update(w, g, bufs, ratios, *, lr, momentum, weight_decay, nesterov):
    """``w -= lr * momentum_step(r * (g + weight_decay * w))`` over lists, without temporaries on CPU.

    ``ratios`` is a 1-D tensor (one ratio per tensor) or None for ``r = 1``. The decayed gradient is
    never materialised: ``buf = momentum * buf + r * g + r * weight_decay * w`` and the direct term of a
    Nesterov or momentum-free step is applied as ``w *= 1 - lr * r * weight_decay; w -= lr * r * g``.
    """
    def add_r_times(target, source, factor):  # target += factor * r * source
        if ratios is None:
            torch._foreach_add_(target, source, alpha=factor)
        else:
            add_scaled_(target, source, ratios, factor)

    if bufs is not None:
        torch._foreach_mul_(bufs, momentum)
        add_r_times(bufs, g, 1.0)
        if weight_decay:
            add_r_times(bufs, w, weight_decay)
        if not nesterov:
            torch._foreach_add_(w, bufs, alpha=-lr)
            return
    # direct term r * (g + wd * w), using w before it changes
    if weight_decay:
        shrink = 1.0 - lr * weight_decay
        torch._foreach_mul_(w, shrink if ratios is None else per_tensor_scalars(1.0 - lr * weight_decay * ratios))
    add_r_times(w, g, -lr)
    if bufs is not None:  # nesterov: + momentum * buf
        torch._foreach_add_(w, bufs, alpha=-lr * momentum)


def _multi_tensor_lars(params, grads, momentum_buffers, *, lr, momentum, weight_decay, ratio, nesterov, adapt,
                       bucket_elems, plans=None):
    update = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    for (device, _, _), idx in group_by_device_dtype_step(params, [0] * len(params)).items():
        G = [grads[i] for i in idx]
        size = default_bucket_elems(device) if bucket_elems is None else (bucket_elems or None)
        persistent = [[params[i] for i in idx]]
        if momentum_buffers is not None:
            persistent.append([momentum_buffers[i] for i in idx])
        plan = cached_plan(plans, persistent, size)
        piece_norms: List[torch.Tensor] = []
        for k, (bucket, views) in enumerate(zip(plan.buckets, plan.views)):
            p, bufs = views[0], (views[1] if momentum_buffers is not None else None)
            w, g = working_copies(plan, k, p, plan.take(k, G), 1.0)
            if adapt and plan.cut[bucket[0][0]]:
                # A piece of a cut tensor: the whole-tensor norms come first; right after the last piece
                # (its pieces still in cache) sweep the pieces again to update them.
                piece_norms.append(norms([w[0], g[0]]))
                if plan.is_last_piece(k):
                    w_norm, g_norm = torch.stack(piece_norms).square().sum(0).sqrt().unbind()
                    piece_norms = []
                    ratios = lars_trust_ratio(w_norm, g_norm, **ratio).reshape(1)
                    for kk in plan.pieces_of[bucket[0][0]]:
                        p_piece = plan.views[kk][0]
                        bufs_piece = plan.views[kk][1] if momentum_buffers is not None else None
                        w_piece, g_piece = working_copies(plan, kk, p_piece, plan.take(kk, G), 1.0)
                        _foreach_update(w_piece, g_piece, bufs_piece, ratios, **update)
                        write_back(p_piece, w_piece)
                continue
            ratios = None
            if adapt:
                ratios = lars_trust_ratio(norms(w), norms(g), **ratio)
            _foreach_update(w, g, bufs, ratios, **update)
            write_back(p, w)
