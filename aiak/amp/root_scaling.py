"""fp16 loss scaling at the root of each backward pass, without owning the script's ``backward()`` call.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2) multiplies the loss by S
before the backward pass so that small gradients survive fp16, and divides every gradient by S once it has left
the half-precision computation. apex, ``torch.amp.GradScaler`` and the frameworks' precision plugins do it at the
root because they own the call (``scaler.scale(loss).backward()``). aiak leaves the script's ``loss.backward()``
as it is, so it finds the root where every backward pass goes through: torch's ``_engine_run_backward``, which
``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` all call (and so does a script
that imported ``grad`` or ``backward`` under another name).

For a pass whose graph reaches a trainable parameter of a model that computes in fp16 under aiak (registered
here by :mod:`aiak.amp.half_compute`), the wrapper

* multiplies the root gradients by S (the smallest scale of the models reached, ``LossScaler.grad_scale``: one
  factor for the whole pass);
* divides by S every gradient the pass hands back: on the way into each leaf's ``.grad`` (a pre-hook on its
  ``AccumulateGrad`` node, so DDP's reducer, post-accumulate hooks and the step controller already see the true
  gradient), the parameters of models aiak never saw and a non-parameter leaf such as an adversarial input
  included, and on the values ``torch.autograd.grad`` returns (a differentiable division under
  ``create_graph``, so a gradient penalty built on them is exact).

So every path from any loss to any tensor is multiplied and divided by the same factor exactly once: an
auxiliary loss kept on a module, a loss on a feature a forward hook captured, a penalty on the parameters, a
gradient penalty, a loss through two models. An overflow leaves inf/NaN in the gradients, which the step
controller finds and skips.

A backward pass started inside a scaled one (reentrant activation checkpointing recomputes a block and runs a
backward of its own) receives gradients that are scaled already: it is not multiplied again, and only what lands
in ``nn.Parameter`` leaves is divided (the recomputed block's detached inputs hand their gradients back to the
outer pass, which divides them where they land). A pass whose root was scaled by the script's own
``GradScaler`` is left alone (:mod:`aiak.amp.script_scaler`: that model's scaler stands aside). A backward pass
that reaches no trainable fp16 parameter (the gradient of a frozen fp16 model's input, say) is not scaled.

The cost is one walk of the backward graph per pass while an fp16 model is alive (no walk otherwise): measured by
``benchmarks/overhead.py``.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn


class _Registry:
    """Trainable parameter -> the LossScaler of the model computing with it in fp16, held weakly and looked up by
    ``id`` (a lookup per leaf per backward: no weak reference made to look one up)."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: Dict[int, Tuple[weakref.ref, Any]] = {}

    def __setitem__(self, param: torch.Tensor, scaler) -> None:
        key = id(param)
        entries = self._entries

        def forget(ref, key=key):
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(param, forget), scaler)

    def get(self, param: torch.Tensor):
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def __contains__(self, param: torch.Tensor) -> bool:
        return self.get(param) is not None

    def __len__(self) -> int:
        return len(self._entries)


_scalers = _Registry()
_in_flight: List[float] = []        # factors of the scaled backward passes running now (innermost last)
_lock = threading.Lock()
_original = None                    # torch's _engine_run_backward while the wrapper is installed


def register(param: torch.Tensor, scaler) -> None:
    """``param`` is computed with in fp16 by a model whose loss scaler is ``scaler``."""
    _scalers[param] = scaler


def watch() -> None:
    """Install the wrapper around torch's ``_engine_run_backward`` (once per process)."""
    global _original
    with _lock:
        if _original is not None:
            return
        graph = torch.autograd.graph
        if not hasattr(graph, "_engine_run_backward"):
            raise RuntimeError(f"aiak: fp16 loss scaling needs torch.autograd.graph._engine_run_backward (torch >= "
                               f"2.3); this torch is {torch.__version__}: use precision.dtype bf16, or upgrade torch")
        _original = graph._engine_run_backward
        graph._engine_run_backward = _run_backward
        torch.autograd._engine_run_backward = _run_backward


def unwatch() -> None:
    """Put torch's ``_engine_run_backward`` back."""
    global _original
    with _lock:
        if _original is None:
            return
        torch.autograd.graph._engine_run_backward = _original
        torch.autograd._engine_run_backward = _original
        _original = None


def scalers_reached(roots) -> list:
    """The loss scalers of the fp16 models whose trainable parameters the graph of ``roots`` (a tensor, or a tuple
    or list of tensors and gradient edges, as ``GradScaler.scale`` and the autograd entries take) reaches."""
    return _walk(roots)[1]


_ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).expand(1).grad_fn.next_functions[0][0])


def _walk(roots) -> Tuple[list, list]:
    """``(AccumulateGrad nodes, loss scalers)`` reached from ``roots`` (tensors or gradient edges)."""
    if not isinstance(roots, (tuple, list)):  # one root (an iterator is never consumed here: its owner reads it)
        roots = (roots,)
    stack = [r.node if isinstance(r, torch.autograd.graph.GradientEdge) else r.grad_fn
             for r in roots if isinstance(r, (torch.Tensor, torch.autograd.graph.GradientEdge))]
    seen, leaves, scalers = set(), [], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node) is _ACCUMULATE_GRAD:
            leaves.append(node)
            scaler = _scalers.get(node.variable)
            if scaler is not None and all(scaler is not s for s in scalers):
                scalers.append(scaler)
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves, scalers


class _Divide:
    """An ``AccumulateGrad`` pre-hook: the gradient on its way into a leaf's ``.grad``, divided by the factor."""

    __slots__ = ("inverse",)

    def __init__(self, factor: float):
        self.inverse = 1.0 / factor

    def __call__(self, grads: Sequence[Optional[torch.Tensor]]):
        grad = grads[0]  # an AccumulateGrad node has one input
        return grads if grad is None else (grad * self.inverse,)


def _run_backward(t_outputs, *args: Any, **kwargs: Any):
    original = _original if _original is not None else torch.autograd.graph._engine_run_backward
    if not _scalers or not args:
        return original(t_outputs, *args, **kwargs)
    accumulate = kwargs.get("accumulate_grad", True)
    if _in_flight and torch._C._current_graph_task_id() != -1:
        return _nested(original, t_outputs, args, kwargs, accumulate)
    leaves, scalers = _walk(t_outputs)
    factor = min((s.grad_scale() for s in scalers), default=1.0)
    if factor == 1.0:  # no fp16 model reached, or the script's GradScaler scaled this root
        return original(t_outputs, *args, **kwargs)
    grads = tuple(g * factor if g is not None else None for g in args[0])
    divide = _Divide(factor)
    handles = [leaf.register_prehook(divide) for leaf in leaves] if accumulate else []
    _in_flight.append(factor)
    try:
        result = original(t_outputs, grads, *args[1:], **kwargs)
    finally:
        _in_flight.pop()
        for handle in handles:
            handle.remove()
    if accumulate:
        return result
    return tuple(g * divide.inverse if g is not None else None for g in result)


def _nested(original, t_outputs, args, kwargs, accumulate: bool):
    """A backward pass run from inside a scaled one: its gradients are scaled already; divide those that land in
    parameters, and hand the rest back scaled to the pass that asked for them."""
    if not accumulate:
        return original(t_outputs, *args, **kwargs)
    divide = _Divide(_in_flight[-1])
    leaves, _ = _walk(t_outputs)
    handles = [leaf.register_prehook(divide) for leaf in leaves if isinstance(leaf.variable, nn.Parameter)]
    try:
        return original(t_outputs, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
