"""Half-precision compute regions: the model's parameters stay the user's fp32 tensors, a forward computes
with half copies made in the autograd graph.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` and DeepSpeed's bf16 mode work this way: the tensors the
user, the optimizer, an EMA copy, a checkpoint and DDP see are the parameters as they were built (fp32);
only the computation is in half. Numerically this is apex's O2 (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, figure 1: a half copy of the fp32 weights for the forward and backward, the update in
fp32), with no master copy to keep in sync: the cast is an autograd op, so each gradient arrives on the fp32
parameter in fp32, and gradients summed over accumulation micro-steps are summed in fp32.

How a module computes in half (:class:`HalfCompute`, one object per model, hooked on its modules):

* Every module whose subtree owns floating parameters or buffers (normalization layers and what is inside them
  excepted) gets a forward pre-hook and an always-called forward hook, bound methods of the model's one
  :class:`HalfCompute`. No closure over a module, a tensor or a bound ``forward``: ``copy.deepcopy`` (EMA,
  ``AveragedModel``) and ``torch.save`` of the whole model give an independent model that computes the same way
  with its own weights.
* The first such module entered (in a thread) opens a *region*: for O2 it swaps each floating parameter and
  buffer of its subtree, in ``_parameters`` / ``_buffers``, for a half copy (``p.to(bf16)``, an op of the
  autograd graph), runs with autocast off, and puts the originals back on the way out; a buffer the forward
  changed in place (a running statistic outside a norm layer) is written back. Modules inside the region find
  their tensors swapped already and do nothing. So ``model(x)``, a LightningModule's ``self.net(x)``,
  ``model.backbone(x)`` and a submodule called alone all compute in half; a parameter read by a parent
  (tied weights) is the same half copy; a module called T times casts once.
* For O1, the region runs the forward under ``torch.autocast`` (what to cast is autocast's choice).
* At a region's boundary floating inputs are cast to the half dtype (O2) and floating outputs to fp32, as
  apex's O2 does at the model's entry and exit.
* Normalization layers (``is_norm_layer``) keep fp32 parameters and buffers; torch's BatchNorm, LayerNorm and
  GroupNorm take half inputs natively, other ``*Norm*`` classes get their inputs in fp32 and return the
  region's dtype.

Loss scaling for fp16 (:class:`~aiak.amp.loss_scaler.LossScaler`) is applied where the region is: the gradient
flowing into a region's outputs is multiplied by the scale, and divided by it again where it leaves the region
(the cast of each parameter, an unscaling alias for a normalization layer's fp32 parameters and for O1's, and the
region's inputs). So every gradient that reaches an fp32 parameter is
already unscaled, whatever the loss did: a penalty computed on the parameters outside the model, or a loss
from two regions (``head(backbone(x))`` called as two), is exact, and no loss path needs a hook. An overflow
inside a region leaves inf/NaN on the gradients, which the step controller finds and skips.

Activation checkpointing recomputes a region's forward inside the backward pass: there the region takes the
role it had in the forward (a block whose inputs are already in the half dtype, or under autocast, is inside
a region), so the recomputed tensors match the saved ones.
"""
from __future__ import annotations

import threading
from typing import Any, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from aiak.util.nested import iter_tensors, map_tensors
from aiak.util.norm_layers import is_norm_layer

# These accept a half input with fp32 weights natively (CPU and CUDA) and return the input's dtype.
NATIVE_MIXED_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
HALF_DTYPES = (torch.float16, torch.bfloat16)


# -- gradient scaling inside the graph -----------------------------------------------------------------

class _CastForCompute(torch.autograd.Function):
    """A parameter's compute copy under loss scaling, or one whose gradient may be sparse: ``p.to(dtype)``
    forward (``dtype`` None: an alias, for O1); backward returns the gradient in fp32, divided by the loss scale
    read at backward time (``scaler`` None: not divided). A sparse gradient stays sparse (the backward of a
    plain ``p.to(dtype)`` refuses one: "to(options) doesn't support converting to a different layout")."""

    @staticmethod
    def forward(ctx, p: torch.Tensor, dtype: Optional[torch.dtype], scaler) -> torch.Tensor:
        ctx.scaler = scaler
        return p.to(dtype) if dtype is not None else p.view_as(p)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.float()
        if ctx.scaler is not None:
            grad = grad * (1.0 / ctx.scaler.grad_scale())
        return grad, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the loss scale (``inverse``: divides).

    The forward returns ``x.detach()``: the same memory and version counter as ``x``, and not a view in
    autograd's sense, so an in-place op on a region's output (``loss *= w``, which Hugging Face's Trainer does)
    behaves as it would on the plain model's output.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scaler, inverse: bool) -> torch.Tensor:
        ctx.scaler, ctx.inverse = scaler, inverse
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale = ctx.scaler.grad_scale()
        return (grad / scale if ctx.inverse else grad * scale), None, None


def scaling_node_scaler(node) -> Optional[Any]:
    """The loss scaler of ``node`` if it is the backward of a region's output scaling (:class:`_ScaleGrad`, not
    the inverse one on a region's inputs), else None."""
    if isinstance(node, _ScaleGrad._backward_cls) and not getattr(node, "inverse", True):
        return node.scaler
    return None


# -- the regions ----------------------------------------------------------------------------------------

class _Frame:
    """One hooked module call: what it swapped (to put back on the way out) and what it entered."""

    __slots__ = ("module", "swapped", "modules", "autocast", "boundary")

    def __init__(self, module: nn.Module):
        self.module = module
        self.swapped: List[Tuple[dict, str, torch.Tensor, torch.Tensor, int]] = []  # (owner dict, name, original, copy, version)
        self.modules: List[int] = []      # ids of the modules whose tensors this call swapped
        self.autocast: Any = None
        self.boundary = False


class _ThreadState(threading.local):
    def __init__(self):
        self.frames: List[_Frame] = []
        self.swapped: Set[int] = set()    # ids of modules whose tensors an open frame swapped


_threads = _ThreadState()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class HalfCompute:
    """The hooks that make one model compute in ``dtype`` (see the module docstring). ``level``: ``O1``
    (autocast) or ``O2`` (half copies of the parameters); ``scaler``: a LossScaler for fp16, else None."""

    __slots__ = ("level", "dtype", "device_type", "scaler")

    def __init__(self, level: str, dtype: torch.dtype, device_type: str, scaler=None):
        self.level, self.dtype, self.device_type, self.scaler = level, dtype, device_type, scaler

    # -- installing -------------------------------------------------------------------------------
    def install(self, model: nn.Module) -> int:
        """Hook every module of ``model`` that computes with floating tensors; returns how many were hooked."""
        _run_eagerly_under_torch_compile()
        hooked = 0
        for module in _modules_outside_norms(model):
            if _owns_floating(module):
                module.register_forward_pre_hook(self.enter, with_kwargs=True, prepend=True)
                module.register_forward_hook(self.leave, always_call=True)
                hooked += 1
        if self.level == "O2":
            keep = NormInFp32(self.dtype)
            for module in model.modules():
                if is_norm_layer(module) and not isinstance(module, NATIVE_MIXED_NORMS):
                    module.register_forward_pre_hook(keep.enter, with_kwargs=True)
                    module.register_forward_hook(keep.leave)
        return hooked

    # -- the hooks --------------------------------------------------------------------------------
    def enter(self, module: nn.Module, args, kwargs):
        state = _threads
        frame = _Frame(module)
        state.frames.append(frame)
        if id(module) in state.swapped:
            return None  # inside a region that already swapped this module's tensors
        frame.boundary = len(state.frames) == 1 and not self._recomputing_inside(args, kwargs)
        if self.level == "O2" or self.scaler is not None:
            self._swap(frame, module)
        if frame.boundary:
            args, kwargs = self._inputs(args), self._inputs(kwargs)
            if self.level == "O1":
                frame.autocast = torch.autocast(self.device_type, dtype=self.dtype)
            elif torch.is_autocast_enabled(self.device_type):  # the script's autocast: O2 does its own casting
                frame.autocast = torch.autocast(self.device_type, enabled=False)
            if frame.autocast is not None:
                frame.autocast.__enter__()
            return args, kwargs
        return None

    def leave(self, module: nn.Module, args, output):
        state = _threads
        if not state.frames or state.frames[-1].module is not module:
            return None  # this call's enter() never ran (an earlier pre-hook raised)
        frame = state.frames.pop()
        for owner, name, original, copy, version in frame.swapped:
            if owner.get(name) is copy:
                owner[name] = original
                if copy._version != version and not isinstance(original, nn.Parameter):
                    with torch.no_grad():
                        original.copy_(copy)  # a buffer the forward updated in place
        state.swapped.difference_update(frame.modules)
        if frame.autocast is not None:
            frame.autocast.__exit__(None, None, None)
        if frame.boundary and output is not None:
            return map_tensors(output, self._output)
        return None

    # -- what a region does -----------------------------------------------------------------------
    def _recomputing_inside(self, args, kwargs) -> bool:
        """Inside a backward pass (activation checkpointing recomputes a forward): a module whose inputs are
        already in the compute dtype, or that runs under autocast, was inside a region when it first ran."""
        if not _in_backward():
            return False
        if self.level == "O1":
            return torch.is_autocast_enabled(self.device_type)
        return any(t.dtype == self.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point())

    def _swap(self, frame: _Frame, module: nn.Module) -> None:
        """Swap the tensors of every module of ``module``'s subtree: floating parameters for their compute copies
        (O2: half, except in normalization layers; under loss scaling, a copy that unscales its gradient) and,
        for O2, floating buffers outside normalization layers for half copies."""
        state = _threads
        grad = torch.is_grad_enabled()
        copies = {}  # id(tensor) -> its copy: a tensor shared by two modules (tied weights) is cast once
        for m, in_norm in _modules_of(module):
            if id(m) in state.swapped:
                continue
            state.swapped.add(id(m))
            frame.modules.append(id(m))
            half = self.dtype if self.level == "O2" and not in_norm else None
            sparse = getattr(m, "sparse", False) is True  # nn.Embedding / EmbeddingBag(sparse=True)
            for name, p in m._parameters.items():
                if p is not None and p.is_floating_point():
                    copy = copies.get(id(p))
                    if copy is None:
                        copy = copies[id(p)] = self._param_copy(p, half, grad, sparse)
                    if copy is not p:
                        frame.swapped.append((m._parameters, name, p, copy, copy._version))
                        m._parameters[name] = copy
            if half is None:
                continue
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != half:
                    copy = copies.get(id(b))
                    if copy is None:
                        copy = copies[id(b)] = b.detach().to(half)
                    frame.swapped.append((m._buffers, name, b, copy, copy._version))
                    m._buffers[name] = copy

    def _param_copy(self, p: torch.Tensor, half: Optional[torch.dtype], grad: bool,
                    sparse: bool = False) -> torch.Tensor:
        half = half if half is not None and p.dtype != half else None
        if not (grad and p.requires_grad):
            return p.detach().to(half) if half is not None else p
        if self.scaler is not None or (sparse and half is not None):
            return _CastForCompute.apply(p, half, self.scaler)
        return p.to(half) if half is not None else p

    def _inputs(self, obj):
        return map_tensors(obj, self._input) if self.level == "O2" or self.scaler is not None else obj

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if self.scaler is not None and t.requires_grad:
            t = _ScaleGrad.apply(t, self.scaler, True)  # a gradient leaving the region is unscaled
        return t.to(self.dtype) if self.level == "O2" else t

    def _output(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        if t.dtype != torch.float32:
            t = t.float()
        if self.scaler is not None and t.requires_grad:
            t = _ScaleGrad.apply(t, self.scaler, False)
        return t

    def __repr__(self) -> str:
        return f"HalfCompute({self.level}, {self.dtype}, scaler={self.scaler!r})"


_eager_hooks = False


def _run_eagerly_under_torch_compile() -> None:
    """``torch.compile`` runs the region hooks eagerly (a graph break where a region opens and closes): traced,
    the swap of parameters for their compute copies lost the parameters' gradients. Done once, at the first
    install, because ``torch.compiler.disable`` imports ``torch._dynamo`` (heavy for ``import aiak``)."""
    global _eager_hooks
    if not _eager_hooks:
        _eager_hooks = True
        HalfCompute.enter = torch.compiler.disable(HalfCompute.enter, reason="aiak's half-precision region")
        HalfCompute.leave = torch.compiler.disable(HalfCompute.leave, reason="aiak's half-precision region")


class NormInFp32:
    """A normalization layer torch has no mixed kernel for: fp32 inputs in, the region's dtype out."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def enter(self, module, args, kwargs):
        if not _threads.frames:
            return None
        to_fp32 = lambda t: t.float() if t.dtype in HALF_DTYPES else t  # noqa: E731
        return map_tensors(args, to_fp32), map_tensors(kwargs, to_fp32)

    def leave(self, module, args, output):
        if not _threads.frames:
            return None
        return map_tensors(output, lambda t: t.to(self.dtype) if t.dtype == torch.float32 else t)


# -- which modules ----------------------------------------------------------------------------------

def _modules_outside_norms(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and its submodules, each once, outside normalization layers."""
    return (module for module, in_norm in _modules_of(model) if not in_norm)


def _modules_of(model: nn.Module) -> Iterator[Tuple[nn.Module, bool]]:
    """``(module, inside a normalization layer?)`` for ``model`` and each of its submodules, once each."""
    seen: Set[int] = set()
    stack = [(model, False)]
    while stack:
        module, in_norm = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        in_norm = in_norm or is_norm_layer(module)
        yield module, in_norm
        stack.extend((m, in_norm) for m in module._modules.values() if m is not None)


def _owns_floating(module: nn.Module) -> bool:
    """The module or a submodule outside norm layers owns a floating parameter or buffer."""
    for m in _modules_outside_norms(module):
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and t.is_floating_point():
                return True
    return False


def half_compute_of(model: nn.Module) -> Optional[HalfCompute]:
    """The :class:`HalfCompute` hooked on ``model`` (or on the model a DDP wraps), if any."""
    model = getattr(model, "module", model)
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, HalfCompute):
            return owner
    return None
