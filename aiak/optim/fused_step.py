"""The fused step of torch's own optimizers, turned on for the script's optimizer (``optimizer.fused``).

``torch.optim.Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` each have three implementations of the same update: a
loop over the parameters (torch's default on a CPU), the multi-tensor ``foreach`` form (its default on CUDA) and a
``fused`` kernel that updates each parameter in one pass (``fused=True``, off unless asked for). The fused kernel
computes the same formulas, rounded differently (the weights within 1e-5 relative of the loop's after six steps:
`tests/optim/test_fused_step.py`), and on this project's CPU steps 1.9-3.7x faster than the loop
(`benchmarks/fused_step.py`). aiak chooses it and keeps the script's view of the optimizer unchanged:

* its checkpoints say ``fused`` and ``foreach`` as the script set them (a state-dict post hook), and loading one
  keeps the fused step on (a load post hook);
* torch's fused SGD with momentum fails on a step where a parameter has its first gradient while others already
  have momentum buffers (a layer unfrozen later, a head used from some step on: ``TypeError ... got NoneType``):
  that one step runs torch's loop, which starts the new buffers as the loop does (a step pre and post hook);
* optimizers it cannot serve are left as they are, with the reason: another class, or a subclass with its own
  ``step``; ``differentiable=True``; ``fused=False`` set by the script; a parameter that is not a floating-point
  tensor on a CPU or CUDA device; sparse gradients (an ``Embedding(sparse=True)``), which only the loop takes;
  sharded parameters (DTensors: FSDP2, tensor parallelism), for which torch has sharding rules of its fused Adam
  but not of its fused SGD or Adagrad.

A deep copy or a pickle of the optimizer keeps ``fused=True`` in its groups but not the hooks (torch copies an
optimizer's defaults, state and groups only): the copy steps fused, and its checkpoints say ``fused: True``.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from aiak.runtime.marks import mark, marked, unmark
from aiak.util.dist import is_dtensor

__all__ = ["FUSED_CLASSES", "fused_step_refusal", "use_fused_step"]

FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
_DEVICES = ("cpu", "cuda")
_ORIGINAL = "_aiak_fused_step"   # the optimizer's mark: the script's settings, per group
_STEPPING_LOOP = "_aiak_fused_step_loop"   # the groups one step runs in the loop


def _torch_class_stepping(cls: type) -> Optional[type]:
    """The class of `FUSED_CLASSES` whose ``step`` and ``_init_group`` ``cls`` runs (torch wraps a class's ``step``
    in its profiling hook at the first instance, a subclass's too: compared unwrapped), or None."""
    step = inspect.unwrap(getattr(cls, "step", None))
    return next((c for c in FUSED_CLASSES if issubclass(cls, c) and step is inspect.unwrap(c.step)
                 and getattr(cls, "_init_group", None) is getattr(c, "_init_group", None)), None)


def fused_step_refusal(optimizer: Any, model: Optional[nn.Module] = None, sharded: bool = False) -> Optional[str]:
    """Why ``optimizer`` cannot take torch's fused step.

    Args:
        optimizer: the script's optimizer.
        model: the model it trains, whose sparse embeddings (``Embedding(sparse=True)``) the fused step cannot take.
        sharded: the parameters are, or are about to be, DTensors.

    Returns:
        The reason, one sentence; None when it can.
    """
    cls = type(optimizer)
    if _torch_class_stepping(cls) is None:
        names = ", ".join(c.__name__ for c in FUSED_CLASSES)
        why = "has a step of its own" if issubclass(cls, FUSED_CLASSES) else "has no fused step in torch"
        return f"{cls.__name__} {why} (torch's {names} have one)"
    groups = optimizer.param_groups
    if any(g.get("differentiable") for g in groups):
        return "the optimizer is differentiable=True, which torch's fused step does not support"
    if any(g.get("fused") is False for g in groups) and marked(optimizer, _ORIGINAL) is None:
        return "the script set fused=False"
    if sharded or any(is_dtensor(p) for g in groups for p in g["params"]):
        return "the parameters are sharded (DTensors): aiak serves the fused step to plain tensors only"
    for g in groups:
        for p in g["params"]:
            if not torch.is_floating_point(p) or p.is_sparse or p.device.type not in _DEVICES:
                return (f"a parameter is {p.dtype} on {p.device.type}; the fused step takes floating-point tensors "
                        f"on {' or '.join(_DEVICES)}")
    if model is not None:
        sparse = {id(m.weight) for m in model.modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        if any(id(p) in sparse for g in groups for p in g["params"]):
            return "the model has sparse gradients (Embedding(sparse=True)), which only the loop step takes"
    return None


def use_fused_step(optimizer: Any, model: Optional[nn.Module] = None, sharded: bool = False) -> str:
    """Turn on torch's fused step in every param group of ``optimizer``, and in groups added later. Calling it again
    changes nothing.

    Args:
        optimizer: the script's optimizer (torch's Adam, AdamW, SGD or Adagrad), changed in place.
        model: the model it trains.
        sharded: the parameters are, or are about to be, DTensors.

    Returns:
        What was done, for the decision record: ``on: ...``, or ``skipped: <why>`` (`fused_step_refusal`).
    """
    refusal = fused_step_refusal(optimizer, model, sharded)
    if refusal is not None:
        return f"skipped: {refusal}"
    if marked(optimizer, _ORIGINAL) is None:
        mark(optimizer, _ORIGINAL, {"groups": [_flags(g) for g in optimizer.param_groups],
                                    "defaults": _flags(optimizer.defaults)})
        optimizer.register_state_dict_post_hook(_save_the_scripts_flags)
        optimizer.register_load_state_dict_post_hook(_fuse_groups)
        if isinstance(optimizer, torch.optim.SGD):
            optimizer.register_step_pre_hook(_loop_for_new_momentum_buffers)
            optimizer.register_step_post_hook(_fused_again)
    optimizer.defaults.update(fused=True, foreach=None)
    _fuse_groups(optimizer)
    return f"on: {type(optimizer).__name__}(fused=True), torch's one-pass kernel instead of its per-parameter loop"


def _flags(group: Dict[str, Any]) -> Dict[str, Any]:
    return {key: group.get(key) for key in ("fused", "foreach")}


def _fuse_groups(optimizer: Any) -> None:
    """Every group fused; the step counters where torch's fused kernel keeps them (float32, on the parameter's
    device: what ``load_state_dict`` does for a fused optimizer), moved in place (``.data``) so that a rollback
    of ``optimize()`` puts them back."""
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=None)
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                step.data = step.data.to(device=p.device, dtype=torch.float32)


def _save_the_scripts_flags(optimizer: Any, state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's groups say ``fused`` and ``foreach`` as the script set them (groups added after
    ``optimize()`` as the optimizer's defaults did)."""
    original = marked(optimizer, _ORIGINAL)
    for i, group in enumerate(state_dict["param_groups"]):
        group.update(original["groups"][i] if i < len(original["groups"]) else original["defaults"])
    return state_dict


def _loop_for_new_momentum_buffers(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Torch's fused SGD starts momentum buffers only when no parameter has one; a step on which some parameters
    get their first gradient while others have buffers runs the loop, group by group."""
    loop: List[Dict[str, Any]] = []
    for group in optimizer.param_groups:
        if group["fused"] and group["momentum"] != 0:
            with_grad = [p for p in group["params"] if p.grad is not None]
            started = sum("momentum_buffer" in optimizer.state.get(p, ()) for p in with_grad)
            if 0 < started < len(with_grad):
                group["fused"] = False
                loop.append(group)
    if loop:
        mark(optimizer, _STEPPING_LOOP, loop)


def _fused_again(optimizer: Any, args: Any, kwargs: Any) -> None:
    for group in marked(optimizer, _STEPPING_LOOP, ()):
        group["fused"] = True
    unmark(optimizer, _STEPPING_LOOP)
