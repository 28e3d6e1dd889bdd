"""Factors at the root of each backward pass, without owning the script's ``backward()`` call: fp16 loss scaling,
and the item counts of an accumulation window.

Loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2) multiplies the loss by S
before the backward pass so that small gradients survive fp16, and divides every gradient by S once it has left
the half-precision computation. apex, ``torch.amp.GradScaler`` and the frameworks' precision plugins do it at the
root because they own the call (``scaler.scale(loss).backward()``). aiak leaves the script's ``loss.backward()``
as it is, so it finds the root where every backward pass goes through: torch's ``_engine_run_backward``, which
``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` all call (and so does a script
that imported ``grad`` or ``backward`` under another name).

For a pass whose graph reaches a trainable parameter of a model that computes in fp16 under aiak (registered
here by `aiak.amp.half_compute`), the wrapper

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
outer pass, which divides them where they land). The outer pass itself cannot see the parameters of a reentrant
checkpoint's block (its graph is built when the backward recomputes it), so the walk reads them off the checkpoint's
function (the module it calls): a LoRA model whose every adapter computes inside checkpoints is scaled like any
other (it ran unscaled, and its fp16 gradients between the blocks underflowed to 0). A pass whose root was scaled by the script's own
``GradScaler`` is left alone (`aiak.amp.scaling.script_scaler`: that model's scaler stands aside). A backward pass
that reaches no trainable fp16 parameter (the gradient of a frozen fp16 model's input, say) is not scaled.

Counted items (`aiak.count_items`) use the same root. A micro-batch whose loss is a mean over ``n`` items
must enter the window's gradient as ``n`` times its gradient (the window is then divided by the items of all its
micro-batches, `aiak.step.window_items`): a pass reaching the parameters of an optimizer whose controller
has a pending count (`weigh`, `set_pending`) multiplies its root by ``n`` (by ``n / reference`` under
an fp16 loss scale, the reference a power of two near the first count, so the half-precision graph sees the loss
scale's magnitude; the landing multiplies by the reference again). Leaves of no counting optimizer land true
(divided by the root), so a second optimizer's parameters or an adversarial input reached by the same pass are
not weighted; ``torch.autograd.grad`` is never weighted. One scalar multiply at the root per pass: the counted
parameters' gradients get no extra pass unless an fp16 scale or a second counting optimizer is on the same pass.

The cost is one walk of the backward graph per pass while an fp16 model is alive or a count is pending (no walk
otherwise): measured by ``benchmarks/overhead.py``.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from aiak.runtime import patches


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
_weighers = _Registry()             # trainable parameter -> weak reference to its counting optimizer's weigher
_pending: "weakref.WeakSet" = weakref.WeakSet()  # weighers whose micro-batch's items are counted, not yet stepped
_in_flight: List["_Pass"] = []      # factors of the scaled or weighted backward passes running now, in any thread
_lock = threading.Lock()
_original = None                    # torch's _engine_run_backward while the wrapper is installed (read every pass)
_passes = 0                         # scaled or weighted backward passes started so far (passes_scaled)


def passes_scaled() -> int:
    """How many scaled or weighted backward passes have started in this process: a step's verdict on the loss scale
    is taken once per pass (`aiak.amp.scaling.loss_scaler.LossScaler.update_once`)."""
    return _passes


def register(param: torch.Tensor, scaler) -> None:
    """``param`` is computed with in fp16 by a model whose loss scaler is ``scaler``."""
    _scalers[param] = scaler


def weigh(params, weigher) -> None:
    """The gradients of ``params`` are weighted by ``weigher`` (a step controller counting items, held weakly)
    while it is pending (`set_pending`): ``weigher.root_weight(scaled)`` returns ``(weight, items,
    reference)``, the root of a pass reaching them is multiplied by ``weight`` (``items / reference``), and their
    gradients land multiplied by ``items``. ``reference`` is 1 unless ``scaled`` (an fp16 loss scale is on the
    root too), where a power of two near the items keeps the root's magnitude that of the loss scale."""
    ref = weakref.ref(weigher)
    for p in params:
        _weighers[p] = ref


def set_pending(weigher, pending: bool) -> None:
    """``weigher`` has (or no longer has) a micro-batch's count for the backward passes to come."""
    if pending:
        _pending.add(weigher)
    else:
        _pending.discard(weigher)


def _weigher_of(variable: torch.Tensor):
    ref = _weighers.get(variable)
    return ref() if ref is not None else None


def watch() -> None:
    """Install the wrapper around torch's ``_engine_run_backward`` (once per process: the ``backward-root`` patch
    of `aiak.runtime.patches`)."""
    global _original
    with _lock:
        if patches.installed("backward-root"):
            return
        graph = torch.autograd.graph
        if not hasattr(graph, "_engine_run_backward"):
            raise RuntimeError(f"aiak: fp16 loss scaling needs torch.autograd.graph._engine_run_backward (torch >= "
                               f"2.3); this torch is {torch.__version__}: use precision.dtype bf16, or upgrade torch")
        # Run eagerly under torch.compile: dynamo runs a backward outside its graphs, and tracing this wrapper there
        # cut a compiled train step into a graph per branch (6 where plain GradScaler makes 2).
        wrapper = torch.compiler.disable(_run_backward, reason="aiak's backward root")
        _original = patches.replace("backward-root", graph, "_engine_run_backward", wrapper)
        patches.replace("backward-root", torch.autograd, "_engine_run_backward", wrapper)
        patches.on_undo("backward-root", _forget_original)


def unwatch() -> None:
    """Put torch's ``_engine_run_backward`` back (what ``aiak.undo_patches()`` does for this patch)."""
    with _lock:
        patches.undo("backward-root")


def _forget_original() -> None:
    global _original
    _original = None


def scaler_of(param: torch.Tensor):
    """The loss scaler of the fp16 model computing with ``param``, or None."""
    return _scalers.get(param)


def scalers_reached(roots) -> list:
    """The loss scalers of the fp16 models whose trainable parameters the graph of ``roots`` (a tensor, or a tuple
    or list of tensors and gradient edges, as ``GradScaler.scale`` and the autograd entries take) reaches."""
    return _walk(roots)[1]


_ACCUMULATE_GRAD = type(torch.zeros(1, requires_grad=True).expand(1).grad_fn.next_functions[0][0])
_REENTRANT_CHECKPOINT = CheckpointFunction._backward_cls  # the node of torch.utils.checkpoint(use_reentrant=True)


def _walk(roots) -> Tuple[list, list, list]:
    """``(AccumulateGrad nodes, loss scalers, pending weighers)`` reached from ``roots`` (tensors or gradient
    edges)."""
    stack = _root_nodes(roots)
    seen, leaves, scalers, weighers = set(), [], [], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node) is _ACCUMULATE_GRAD:
            leaves.append(node)
            _reached(node.variable, scalers, weighers)
            continue
        if type(node) is _REENTRANT_CHECKPOINT:  # its graph is built when the backward recomputes it
            for variable in _checkpointed_parameters(node.run_function):
                _reached(variable, scalers, weighers)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves, scalers, weighers


def _reached(variable: torch.Tensor, scalers: list, weighers: list) -> None:
    scaler = _scalers.get(variable)
    if scaler is not None and all(scaler is not s for s in scalers):
        scalers.append(scaler)
    if _pending:
        weigher = _weigher_of(variable)
        if weigher is not None and weigher in _pending and all(weigher is not w for w in weighers):
            weighers.append(weigher)


def _checkpointed_parameters(run_function) -> List[torch.Tensor]:
    """The trainable parameters a reentrant checkpoint's function computes with: those of the modules it is, is a
    method of, or holds (a ``functools.partial``'s function and arguments, a closure's cells, two levels deep).
    The checkpoint's backward recomputes the function and runs a backward of its own, so its parameters are not in
    the graph the outer pass walks; a function whose modules cannot be found counts as reaching every parameter
    registered here (scaling a pass that needed none costs nothing: its gradients land divided)."""
    modules = _modules_held(run_function, 2)
    if not modules:
        return [entry[0]() for entry in list(_scalers._entries.values()) if entry[0]() is not None]
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def _modules_held(fn, depth: int) -> List[nn.Module]:
    if isinstance(fn, nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    if depth == 0:
        return []
    if isinstance(fn, functools.partial):
        held = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        held = [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _filled(cell)]
    return [m for h in held if callable(h) for m in _modules_held(h, depth - 1)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


class _Multiply:
    """An ``AccumulateGrad`` pre-hook: the gradient on its way into a leaf's ``.grad``, multiplied by ``by`` (a number,
    or a 0-dim tensor when the factor came from a counted tensor)."""

    __slots__ = ("by",)

    def __init__(self, by):
        self.by = by

    def __call__(self, grads: Sequence[Optional[torch.Tensor]]):
        grad = grads[0]  # an AccumulateGrad node has one input
        return grads if grad is None else (_times(grad, self.by),)


def _times(grad: torch.Tensor, by) -> torch.Tensor:
    """``grad * by`` in ``grad``'s dtype (a 0-dim factor tensor would otherwise promote a 0-dim half gradient)."""
    if isinstance(by, torch.Tensor):
        return (grad * by.to(grad.device)).to(grad.dtype)
    return grad * by


class _Pass:
    """The factors of one backward pass. ``root`` multiplies its root gradients: the loss scale, times the weight of
    the first counting optimizer reached (its micro-batch's items over its reference). A leaf's gradient is
    multiplied on landing by what brings it to its owner's items (the first owner's: ``reference / scale``, a plain
    number; another counting owner's: ``items / root``) or, for a leaf of no counting optimizer, to its true value
    (``1 / root``)."""

    __slots__ = ("root", "_landing", "unowned", "task")

    def __init__(self, scale: float, weights: Dict[Any, Tuple[Any, Any, float]]):
        self.task = None                  # the autograd engine's id of this pass, once its root node has run
        self._landing: Dict[int, Any] = {}
        self.root = scale
        for i, (owner, (weight, items, reference)) in enumerate(weights.items()):
            if i == 0:
                self.root = scale * weight
                self._landing[id(owner)] = reference / scale
            else:
                self._landing[id(owner)] = items / self.root
        self.unowned = 1.0 / self.root

    def landing(self, variable: torch.Tensor):
        """The factor for ``variable``'s gradient on landing (1.0: none)."""
        owner = _weigher_of(variable) if self._landing else None
        return self._landing.get(id(owner), self.unowned) if owner is not None else self.unowned


def _is_one(x) -> bool:
    return not isinstance(x, torch.Tensor) and x == 1.0


def _run_backward(t_outputs, *args: Any, **kwargs: Any):
    original = _original if _original is not None else torch.autograd.graph._engine_run_backward
    if not (_scalers or _pending) or not args:
        return original(t_outputs, *args, **kwargs)
    accumulate = kwargs.get("accumulate_grad", True)
    outer = _running_inside()
    if outer is not None:
        return _nested(original, t_outputs, args, kwargs, accumulate, outer)
    leaves, scalers, weighers = _walk(t_outputs)
    scale = min((s.grad_scale() for s in scalers), default=1.0)
    weights = {w: w.root_weight(scale != 1.0) for w in weighers} if accumulate else {}
    if scale == 1.0 and not weights:  # no fp16 model or counted items reached, or the script's GradScaler's root
        return original(t_outputs, *args, **kwargs)
    global _passes
    _passes += 1
    factors = _Pass(scale, weights)
    grads = tuple(_times(g, factors.root) if g is not None else None for g in args[0])
    handles = []
    if accumulate:
        for leaf in leaves:
            by = factors.landing(leaf.variable)
            if not _is_one(by):
                handles.append(leaf.register_prehook(_Multiply(by)))
    for node in _root_nodes(t_outputs):
        handles.append(node.register_prehook(_Started(factors)))
    _in_flight.append(factors)
    try:
        result = original(t_outputs, grads, *args[1:], **kwargs)
    finally:
        _in_flight.remove(factors)
        for handle in handles:
            handle.remove()
    if accumulate:
        return result
    return tuple(_times(g, factors.unowned) if g is not None else None for g in result)


class _Started:
    """A pre-hook on a pass's root node: records the engine's id of the pass when it starts (in whatever thread runs
    it: the caller's on a CPU, a device's worker thread on CUDA), so a pass started inside it finds its factors."""

    __slots__ = ("factors",)

    def __init__(self, factors: _Pass):
        self.factors = factors

    def __call__(self, grads):
        self.factors.task = torch._C._current_graph_task_id()
        return None


def _root_nodes(roots) -> list:
    """The graph nodes of ``roots`` (a tensor, or a tuple or list of tensors and gradient edges; an iterator is never
    consumed here: its owner reads it), leaves without a node left out."""
    if not isinstance(roots, (tuple, list)):
        roots = (roots,)
    nodes = [r.node if isinstance(r, torch.autograd.graph.GradientEdge) else r.grad_fn
             for r in roots if isinstance(r, (torch.Tensor, torch.autograd.graph.GradientEdge))]
    return [node for node in nodes if node is not None]


def _running_inside() -> Optional[_Pass]:
    """The factors of the scaled or weighted pass this call runs inside (a reentrant checkpoint's backward), by the
    engine's id of the running pass: not the latest pass of the process, which may be another thread's."""
    if not _in_flight:
        return None
    task = torch._C._current_graph_task_id()
    if task == -1:
        return None
    return next((f for f in reversed(_in_flight) if f.task == task), None)


def _nested(original, t_outputs, args, kwargs, accumulate: bool, factors: _Pass):
    """A backward pass run from inside a scaled one: its gradients are scaled already; bring those that land in
    parameters to their true (or counted) values, and hand the rest back scaled to the pass that asked for them."""
    if not accumulate:
        return original(t_outputs, *args, **kwargs)
    leaves, _, _ = _walk(t_outputs)
    handles = []
    for leaf in leaves:
        if isinstance(leaf.variable, nn.Parameter):
            by = factors.landing(leaf.variable)
            if not _is_one(by):
                handles.append(leaf.register_prehook(_Multiply(by)))
    try:
        return original(t_outputs, *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
