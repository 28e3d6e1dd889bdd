"""fp16 steps of the optimizers aiak was not given: a step whose gradients hold inf/NaN is skipped and the model's
loss scale backs off, whichever optimizer steps the model.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2) needs every step to check
the gradients first: an overflow in fp16 leaves inf/NaN, which a step would write into the weights for good.
``torch.amp.GradScaler`` checks the optimizers the script hands to ``scaler.step(optimizer)``; aiak's step
controller (`aiak.step.controller`) checks the optimizer given to ``aiak.optimize()``. Scripts step fp16 models
with others too: a new optimizer made after unfreezing a backbone, the optimizer of a ``copy.deepcopy`` of the
model (its own loss scaler came with the copy), one optimizer per parameter stepped inside the backward pass
(``register_post_accumulate_grad_hook``, the optimizer-in-backward recipe). Those stepped inf/NaN into the weights,
and the loss scale never moved.

So while an fp16 model exists, a global optimizer step pre-hook (torch's ``register_optimizer_step_pre_hook``, the
``fp16-steps`` patch of `aiak.runtime.patches`) looks at every step of an optimizer that has no step
controller: when it holds parameters of an fp16 model (`aiak.amp.scaling.root_scaling.scaler_of`), it checks all its
gradients for inf/NaN in one fused pass, as ``GradScaler.step`` does, and on an overflow hides them (``.grad``
set to None, which torch's optimizers skip: weights and state untouched) until the step returns, when the
post-hook puts them back. Each model's scaler takes the verdict once per backward pass
(`aiak.amp.scaling.loss_scaler.LossScaler.update_once`): per-parameter optimizers make one step of the scale's schedule,
not one per parameter. A scaler standing aside for the script's own ``GradScaler`` is left to it.

Per-parameter optimizers step as their gradient arrives, so an overflow skips the parameters whose gradients
overflowed; an overflow of the loss itself reaches them all.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from aiak.amp.scaling import root_scaling
from aiak.amp.scaling.loss_scaler import LossScaler
from aiak.runtime import patches
from aiak.runtime.marks import marked

logger = logging.getLogger("aiak")

_hidden: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]] = {}  # id(optimizer) -> gradients hidden for its step


def watch() -> None:
    """Register the global step hooks (once per process: the ``fp16-steps`` patch)."""
    if patches.installed("fp16-steps"):
        return
    hooks = "torch.optim.optimizer._global_optimizer_{}_hooks"  # (the dicts torch's register functions fill)
    patches.hook("fp16-steps", hooks.format("pre"), register_optimizer_step_pre_hook(_before))
    patches.hook("fp16-steps", hooks.format("post"), register_optimizer_step_post_hook(_after))
    patches.on_undo("fp16-steps", _hidden.clear)


def _before(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if marked(optimizer, "_aiak_steps", None) is not None:
        return  # aiak's step controller checks the optimizer it steps
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    scalers: List[LossScaler] = []
    for p in params:
        scaler = root_scaling.scaler_of(p)
        if scaler is not None and not scaler.stood_aside and all(scaler is not s for s in scalers):
            scalers.append(scaler)
    if not scalers:
        return
    found_inf = LossScaler.check_and_multiply_([p.grad for p in params])
    after_pass = root_scaling.passes_scaled()
    for scaler in scalers:
        scaler.update_once(found_inf, after_pass)
    if found_inf:
        logger.info("aiak: inf/NaN gradients, step of %s skipped; loss scale now %g", type(optimizer).__name__,
                    min(s.scale for s in scalers))
        _hidden[id(optimizer)] = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None


def _after(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for p, grad in _hidden.pop(id(optimizer), ()):
        p.grad = grad
