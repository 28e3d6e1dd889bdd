"""A half-precision region as ``torch.compile`` sees it: plain Python that dynamo traces into the model's graph.

The eager region (`aiak.amp.half_compute`) swaps tensors in the modules' ``_parameters`` and puts them back
from forward hooks, with per-thread bookkeeping and a guard that catches ``KeyboardInterrupt``. None of that can be
traced: run eagerly under ``torch.compile`` (``torch.compiler.disable``), it cut the model's graph at every module
that owns parameters (a 4-block MLP made 9 graphs instead of plain autocast's 1, and its compiled step was 2.9x
slower). So while dynamo traces a hooked module's call (``torch.compiler.is_compiling()``), the module's guard calls
`region_call` instead, which does what FSDP2's ``MixedPrecisionPolicy`` does in its traced pre-forward
hooks: compute copies made in the graph, no state kept between calls.

* **O1**: the call runs under ``torch.autocast`` (the region's dtype); floating outputs leave as fp32.
* **O2**: the region's root casts floating inputs to the half dtype and its outputs back to fp32; every hooked
  module inside swaps the floating parameters it owns for their half copies (``p.to(dtype)``, an op of the graph, so
  the gradient lands on the fp32 parameter) at its own call and puts them back after it. Swapping each module's own
  parameters where it is called, not the whole subtree's at the root, keeps the casts in the graph of the code that
  uses them: where the model breaks the graph (GPT-2's loss), a root's casts made a graph of their own before the
  break. The whole region runs under ``torch.autocast``: buffers and the frozen parameters of the model's own module
  classes stay the user's fp32 tensors (an in-place update lands in them exactly, as in the eager region), and an op
  that meets them beside half tensors follows autocast's policy (a matrix product casts to the half dtype, an op
  autocast keeps in fp32 runs in fp32), where the eager region shows them in half outside autocast's fp32 ops
  (`aiak.amp.region_state.RegionState`, a tensor subclass dynamo does not trace). The trainable parameters of the
  model's own module classes are half copies here, where the eager region shows them as the user's fp32 tensors.
* A module kept in fp32 (`aiak.amp.fp32_modules`) called with half inputs runs with autocast off, from fp32
  inputs, its floating outputs cast back to the half dtype (its own call, `aiak.amp.fp32_modules.Fp32Module`).

Modules called inside a region (dynamo inlines them, or runs them after a graph break) find a region open
(`_depth`) and compute with their own parameters' half copies. A compiled module called inside an eager region
(``block.compile()`` on each block of an optimized model) finds its parameters swapped already; the eager region
leaves its buffers as the user's fp32 tensors, and the block runs under autocast as a traced region does.

Where dynamo runs a frame of the model without tracing it (it gave up on the frame after a graph break it could not
resume from), a hooked module called there opens the same region untraced (`region_call_untraced`): the casts and
swaps run eagerly, in functions dynamo never enters, and dynamo starts its next frame at the module's ``forward``, as
it does for plain autocast's modules. Dynamo never starts a frame at aiak's code on the way (`never_a_frame`): a
frame at the guard, one code object shared by every hooked module, traced the hooks Hugging Face installs during the
forward and was compiled again for each layer (wav2vec2's encoder, after LayerDrop's branch, made 7 graphs where
plain autocast makes 6), and a frame at a region's casts made a graph of one op.

fp16's loss scaling needs no work here: it is applied at the root of the backward pass
(`aiak.amp.scaling.root_scaling`) to the parameters handed to it once the strategy applied
(`HalfCompute.scale_trainable`).
"""
from __future__ import annotations

import torch
from torch import nn

from aiak.amp.fp32_modules import HALF_DTYPES
from aiak.runtime.class_swap import original_class
from aiak.util.nested import map_tensors

_depth = 0   # traced regions open in the call dynamo is tracing (a module-level value: dynamo traces its changes)


class CastForCompute(torch.autograd.Function):
    """``p.to(dtype)`` whose backward returns the gradient in fp32 and keeps a sparse gradient sparse (the
    backward of a plain ``p.to(dtype)`` refuses one: "to(options) doesn't support converting to a different
    layout")."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return p.to(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.float(), None


def compute_copy(p: torch.Tensor, dtype: torch.dtype, grad: bool, sparse: bool) -> torch.Tensor:
    """The half copy a region computes with in place of the parameter ``p``: in the autograd graph when ``p``
    trains (``grad``: gradients are being recorded), detached otherwise."""
    if not (grad and p.requires_grad):
        return p.detach().to(dtype)
    if sparse:
        return CastForCompute.apply(p, dtype)
    return p.to(dtype)


def is_state(module: nn.Module, p: torch.Tensor) -> bool:
    """``p``, a parameter of ``module``, is state rather than a weight: frozen, and owned by a module class of the
    model's own (a VQ-VAE's codebook moved by an average in ``forward``), not one of torch's layers. O2 keeps it the
    user's fp32 tensor."""
    return not p.requires_grad and not computes_as_torch_layer(module)


# Layers of other libraries whose ``forward`` uses their parameters as torch's layers do, in one matrix product
# (module of the class defining ``forward``, its name): Hugging Face's ``Conv1D`` (GPT-2's projections) is
# ``addmm(bias, x, weight)``. Their weights get the plain half copies torch's layers get under O2, with no
# dispatch per call: the dispatch cost GPT-2's eager O2 forward about 9% on this project's CPU.
MATRIX_PRODUCT_LAYERS = frozenset({("transformers.pytorch_utils", "Conv1D")})


def computes_as_torch_layer(module: nn.Module) -> bool:
    """``module`` was built as one of torch's own layers (``torch.nn``), whatever class aiak swapped in since (an fp8
    ``Linear`` is still a ``Linear``), or as a layer of `MATRIX_PRODUCT_LAYERS` whose ``forward`` is that class's
    own; not a module class of the model's own, whose ``forward`` may use its parameters with any op."""
    cls = original_class(module) or type(module)
    if cls.__module__.startswith("torch.nn."):
        return True
    forward = getattr(cls, "forward", None)
    owner = getattr(forward, "__qualname__", "").rpartition(".")[0]
    return (getattr(forward, "__module__", None), owner) in MATRIX_PRODUCT_LAYERS


def to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t


def region_call(compute, module: nn.Module, args, kwargs, inside: bool):
    """``module``'s call while dynamo traces it (see the module docstring). ``inside``: an eager region of this
    thread is open, and has swapped the tensors already."""
    global _depth
    call = type(module)._call_impl
    if inside:  # a compiled module inside an eager region: its parameters are half copies, its state is fp32
        if compute.level == "O1":
            return call(module, *args, **kwargs)
        with torch.autocast(compute.device_type, dtype=compute.dtype):
            return call(module, *args, **kwargs)
    if _depth:
        return _with_half_parameters(compute, module, args, kwargs) if compute.level == "O2" else \
            call(module, *args, **kwargs)
    _depth += 1
    try:
        with torch.autocast(compute.device_type, dtype=compute.dtype):
            if compute.level == "O1":
                out = call(module, *args, **kwargs)
            else:
                args, kwargs = _cast_floating((args, kwargs), compute.dtype)
                out = _with_half_parameters(compute, module, args, kwargs)
    finally:
        _depth -= 1
    return _cast_floating(out, torch.float32)


_dynamo_ext = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)  # torch's C side of dynamo
_frame_callback = getattr(_dynamo_ext, "get_eval_frame_callback", lambda: None)


def dynamo_runs_untraced() -> bool:
    """This thread is inside a call of ``torch.compile`` that dynamo runs without tracing: torch's frame callback is
    set. Callers ask ``torch.compiler.is_compiling()`` first; it is not asked here, where a frame dynamo started at
    this function (a torch without `never_a_frame`'s entry point) would answer True and hide the callback."""
    callback = _frame_callback()
    return callback is not None and callback is not False


class _Opened:
    """What `region_call_untraced` opened, to shut it whatever ends the call."""

    __slots__ = ("args", "kwargs", "root", "swapped", "autocast")

    def __init__(self, args, kwargs):
        self.args, self.kwargs, self.root, self.swapped, self.autocast = args, kwargs, False, [], None


def region_call_untraced(compute, module: nn.Module, args, kwargs, inside: bool):
    """``module``'s call where dynamo runs the calling frame without tracing it: what `region_call` does, the region
    opened and shut eagerly (`_open`, `_shut`: never entered by dynamo), the module's own call in between, where
    dynamo starts its frame at the module's ``forward`` (see the module docstring)."""
    opened = _untraced(_open)(compute, module, args, kwargs, inside)
    try:
        out = type(module)._call_impl(module, *opened.args, **opened.kwargs)
    finally:
        _untraced(_shut)(opened)
    return _untraced(_cast_floating)(out, torch.float32) if opened.root else out


def _open(compute, module: nn.Module, args, kwargs, inside: bool) -> _Opened:
    global _depth
    opened = _Opened(args, kwargs)
    o2 = compute.level == "O2"
    if inside:        # an eager region swapped the tensors: autocast only (O2), as region_call does
        if o2:
            opened.autocast = torch.autocast(compute.device_type, dtype=compute.dtype)
    elif _depth:      # inside a region: the module's own parameters (O2)
        if o2:
            opened.swapped = _swap_own(compute, module)
    else:
        _depth += 1
        opened.root = True
        opened.autocast = torch.autocast(compute.device_type, dtype=compute.dtype)
        if o2:
            opened.args, opened.kwargs = _cast_floating((args, kwargs), compute.dtype)
            opened.swapped = _swap_own(compute, module)
    if opened.autocast is not None:
        opened.autocast.__enter__()
    return opened


def _shut(opened: _Opened) -> None:
    global _depth
    for params, name, p in opened.swapped:
        params[name] = p
    if opened.autocast is not None:
        opened.autocast.__exit__(None, None, None)
    if opened.root:
        _depth -= 1


_untraced_made = {}  # fn -> fn under torch.compiler.disable, made at first use (dynamo is loaded by then)


def _untraced(fn):
    made = _untraced_made.get(fn)
    if made is None:
        made = _untraced_made[fn] = torch.compiler.disable(fn, reason="aiak: a region opened or shut in a frame "
                                                                       "dynamo runs without tracing")
    return made


def _cast_floating(obj, dtype: torch.dtype):
    """``obj`` with its floating tensors in ``dtype``: the casts at a region's entry and exit."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t)


def never_a_frame(fn) -> None:
    """Tell dynamo never to start a frame at ``fn``'s code (what ``torch._dynamo.skip`` does, without the flag that
    would stop dynamo inlining it where it traces a caller), through torch's C extension, so dynamo is not loaded
    for it. Without that private entry point the frames start there, which costs graphs, not correctness."""
    ext = _dynamo_ext
    if ext is None or not hasattr(ext, "set_code_exec_strategy"):
        return
    ext.set_code_exec_strategy(fn.__code__, ext._FrameExecStrategy(ext._FrameAction.SKIP, ext._FrameAction.DEFAULT))


for _fn in (dynamo_runs_untraced, region_call_untraced, _untraced):  # called where dynamo does not trace
    never_a_frame(_fn)
del _fn


def _swap_own(compute, module: nn.Module) -> list:
    """O2: each floating parameter ``module`` owns replaced by its half copy; returns ``(params, name, original)``
    to put back. Not the frozen parameters of the model's own module classes: state, kept in fp32 as buffers are."""
    params = module._parameters
    grad = torch.is_grad_enabled()
    sparse = module.__dict__.get("sparse", False) is True  # nn.Embedding / EmbeddingBag(sparse=True)
    swapped = []
    for name, p in list(params.items()):
        if p is None or not p.is_floating_point() or p.dtype in HALF_DTYPES or is_state(module, p):
            continue
        swapped.append((params, name, p))
        params[name] = compute_copy(p, compute.dtype, grad, sparse)
    return swapped


def _with_half_parameters(compute, module: nn.Module, args, kwargs):
    """O2: ``module`` called with each floating parameter it owns replaced by its half copy (`_swap_own`), the
    originals back whatever ends the call."""
    swapped = _swap_own(compute, module)
    try:
        return type(module)._call_impl(module, *args, **kwargs)
    finally:
        for params, name, p in swapped:
            params[name] = p
