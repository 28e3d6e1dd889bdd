"""Half-precision compute regions: the model's parameters stay the user's fp32 tensors, a forward computes
with half copies made in the autograd graph.

FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` and DeepSpeed's bf16 mode work this way: the tensors the
user, the optimizer, an EMA copy, a checkpoint and DDP see are the parameters as they were built (fp32);
only the computation is in half. Numerically this is apex's O2 (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, figure 1: a half copy of the fp32 weights for the forward and backward, the update in
fp32), with no master copy to keep in sync: the cast is an autograd op, so each gradient arrives on the fp32
parameter in fp32, and gradients summed over accumulation micro-steps are summed in fp32.

How a module computes in half (`HalfCompute`, one object per model, hooked on its modules):

* Every module whose subtree owns floating parameters or buffers (outside the modules kept in fp32 and outside
  parametrizations) gets a forward pre-hook, a forward hook and a ``state_dict`` hook, bound
  methods of the model's one `HalfCompute`, and a `_CallGuard` as its instance ``_call_impl``. No
  closure over a module, a tensor or a bound ``forward``: ``copy.deepcopy`` (EMA, ``AveragedModel``) and
  ``torch.save`` of the whole model give an independent model that computes the same way with its own weights.
* The first such module entered (in a thread) opens a *region*. For O2 it swaps each floating parameter of
  torch's own layers in its subtree, in ``_parameters``, for a half copy (``p.to(bf16)``, an op of the autograd
  graph where the parameter trains; a detached copy under ``no_grad``, ``inference_mode`` or for a frozen
  weight), and shows each floating buffer, each parameter of the model's own module classes, the originals of a
  parametrization and an embedding table with ``max_norm`` through a `aiak.amp.region_state.RegionState`
  (the user's fp32 tensor, half where it meets half tensors: counters, running values and EMA codebooks stay
  exact, ``slogdet(self.weight)`` and ``matrix_exp`` run on the fp32 weight, ``self.weight.data = renorm(...)``
  lands in the user's tensor). It runs the forward under ``torch.autocast`` of its dtype, so an op autocast runs
  in fp32 (``quantile``, ``inverse``, a loss; on CUDA ``softmax`` and ``layer_norm`` too) runs in fp32 under O2
  as under autocast, and an fp32 tensor the forward makes (``x.float()`` into a router, a mask times a weight, a
  frozen net the model keeps outside its tree) meets half ones as autocast casts them. On the way out it puts the
  originals back. A parameter copy the forward edited in place or reassigned (a hook that rescales or clamps a
  weight) is written into the parameter, the elements it changed only; a buffer the forward reassigned is stored back in its own dtype.
  Modules inside the region find their tensors swapped already and do nothing (their guard calls ``forward``
  directly, as torch does for a module without hooks, unless the module has hooks of the user's). So ``model(x)``, a
  LightningModule's ``self.net(x)``, ``model.backbone(x)`` and a submodule called alone all compute in half; a
  parameter read by a parent (tied weights) is the same half copy; a module called T times casts once.
* For O1, the region runs the forward under ``torch.autocast`` (what to cast is autocast's choice) and swaps
  nothing. O2 differs from it where autocast leaves an op to its inputs' dtype: O2's activations and weights are
  half there (an elementwise op, a residual sum), O1's may be fp32.
* At a region's boundary floating inputs are cast to the half dtype (O2) and floating outputs to fp32, as
  apex's O2 does at the model's entry and exit.
* Whatever ends the call (a return, an exception, ``KeyboardInterrupt``, ``SystemExit``), the originals are back
  when it leaves: the forward hook for a return, the guard for an exception of any kind. ``state_dict()``
  taken inside a region (in a forward hook) gives the user's tensors.
* Modules kept in fp32 (`aiak.amp.fp32_modules`: normalization layers, ``precision.keep_fp32``, a module
  whose op has no half kernel here) keep fp32 tensors and compute in fp32 from fp32 inputs, autocast off.

fp16 loss scaling is applied at the root of each backward pass, not inside the regions
(`aiak.amp.scaling.root_scaling`). An overflow leaves inf/NaN on the gradients, which the step controller finds
and skips.

While ``torch.compile`` traces the model, the guard opens the region in the graph instead
(`aiak.amp.compiled_region`) and the hooks stand aside; in a frame dynamo runs without tracing (after a graph break
it could not resume from), the guard opens the region untraced around the module's own call, where dynamo starts
its next frame.

Activation checkpointing recomputes a region's forward inside the backward pass: there the region takes the
role it had in the forward (a block whose inputs are already in the half dtype, or under autocast, is inside
a region), so the recomputed tensors match the saved ones.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize

from aiak.amp import compiled_region
from aiak.amp.scaling import fp16_steps, root_scaling
from aiak.amp.compiled_region import compute_copy, computes_as_torch_layer, is_state, to_fp32
from aiak.amp.fp32_modules import (HALF_DTYPES, NATIVE_MIXED_NORMS, called_module, hook_fp32_module, is_kept_fp32,
                                   keep_after_failure)
from aiak.amp.region_state import RegionState, plain_pointer, region_closed, region_opened, unwrap
from aiak.util.nested import iter_tensors, map_tensors


# -- the regions ----------------------------------------------------------------------------------------

class _Frame:
    """One hooked module call: what it swapped (to put back on the way out) and what it entered."""

    __slots__ = ("module", "swapped", "modules", "autocast", "boundary", "shows_state")

    def __init__(self, module: nn.Module):
        self.module = module
        self.shows_state = False          # it shows tensors as RegionState (counted as an open region there)
        # (owner dict, name, original, what the forward sees, its version or None, its data pointer)
        self.swapped: List[Tuple[dict, str, torch.Tensor, torch.Tensor, Optional[int], int]] = []
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

    __slots__ = ("level", "dtype", "device_type", "scaler", "registered", "enabled")

    def __init__(self, level: str, dtype: torch.dtype, device_type: str, scaler=None):
        self.level, self.dtype, self.device_type, self.scaler = level, dtype, device_type, scaler
        # False: the hooked modules compute in fp32 as plain PyTorch does, between two steps (the run-time guard,
        # `aiak.tune.guard`, times both); the parameters are the fp32 ones either way, so nothing else changes
        self.enabled = True
        self.registered: Set[int] = set()  # ids of the parameters handed to root scaling (a copy's are new ids)

    def level_switchable(self, model: nn.Module) -> bool:
        """Whether `switch_level` gives ``model`` exactly the compute a fresh O1 or O2 gives it: bf16 (fp16's loss
        scaling hands parameters over per level), and no module kept in fp32 with O2's own hooks
        (`aiak.amp.fp32_modules.Fp32Module`: a declared ``precision.keep_fp32``, a norm layer torch does not run on
        half inputs, a module without a half kernel), which O1 does not have."""
        return self.scaler is None and self.dtype == torch.bfloat16 and not any(
            kept and not isinstance(module, NATIVE_MIXED_NORMS) for module, kept in _modules_of(model))

    def switch_level(self, model: nn.Module, level: str) -> None:
        """Compute ``model`` at ``level`` (``O1`` or ``O2``) from its next forward, between two steps (the run-time
        guard, `aiak.tune.guard`, times both): the hooks are the same at both levels where `level_switchable`."""
        if level not in ("O1", "O2") or not self.level_switchable(model):
            raise ValueError(f"aiak: cannot switch {self.level} to {level!r} on this model (level_switchable)")
        if _threads.frames:
            raise RuntimeError("aiak: the precision level is switched between steps, not inside a forward")
        self.level = level

    # -- installing -------------------------------------------------------------------------------
    def install(self, model: nn.Module) -> int:
        """Hook every module of ``model`` that computes with floating tensors; returns how many were hooked."""
        hooked = 0
        for module in _region_openers(model):
            module.register_forward_pre_hook(self.enter, with_kwargs=True, prepend=True)
            module.register_forward_hook(self.leave)  # (not always_call: the guard closes what an exception left)
            module._register_state_dict_hook(_state_dict_of_originals)
            vars(module)["_call_impl"] = _CallGuard(module, self)
            vars(module)["__prepare_scriptable__"] = _NotScriptable(self)  # torch.jit.script asks this first
            hooked += 1
        if self.scaler is not None:
            root_scaling.watch()
            fp16_steps.watch()
        if self.level == "O2":
            for module, kept in _modules_of(model):
                if kept and is_kept_fp32(module):
                    hook_fp32_module(module, self.dtype, self.device_type)
        return hooked

    def scale_trainable(self, model: nn.Module) -> None:
        """Hand every trainable parameter ``model`` computes with in fp16 to root scaling now, not only at its first
        eager forward: a forward dynamo traces (`aiak.amp.compiled_region`) cannot. Called once the whole
        strategy applied, so a model ``optimize()`` put back after a failure stays unscaled."""
        if self.scaler is None:
            return
        for module, kept in _modules_of(model):
            if not (kept and self.level == "O2"):  # O1's autocast decides per op: any parameter may meet fp16
                for p in module._parameters.values():
                    if p is not None and p.requires_grad and p.is_floating_point() and p.dtype not in HALF_DTYPES:
                        self._scaled(p)

    # -- the hooks --------------------------------------------------------------------------------
    def enter(self, module: nn.Module, args, kwargs):
        if torch.compiler.is_compiling() or (compiled_region._depth and compiled_region.dynamo_runs_untraced()):
            return None  # the guard made the region (compiled_region.region_call, or region_call_untraced: a region
            #              open while dynamo runs this frame untraced)
        if torch.jit.is_tracing() and self.level == "O2":  # (O1 traces: its autocast is recorded in the graph)
            raise RuntimeError(_not_torchscript("torch.jit.trace", self))
        state = _threads
        frame = _Frame(module)
        state.frames.append(frame)
        if id(module) in state.swapped or not self.enabled:
            return None  # inside a region that already swapped this module's tensors; or plain fp32 compute
        frame.boundary = len(state.frames) == 1 and not self._recomputing_inside(args, kwargs)
        if frame.boundary and self.level == "O1" and self.scaler is not None and torch.is_grad_enabled():
            for p in module.parameters():  # O1 swaps nothing: its parameters are handed over here
                if p.requires_grad and p.is_floating_point():
                    self._scaled(p)
        if self.level == "O2":
            self._swap(frame, module)
        if frame.boundary:
            if self.level == "O2":
                args, kwargs = map_tensors(args, self._input), map_tensors(kwargs, self._input)
            frame.autocast = torch.autocast(self.device_type, dtype=self.dtype)
            frame.autocast.__enter__()
            return args, kwargs
        return None

    def leave(self, module: nn.Module, args, output):
        if torch.compiler.is_compiling() or (compiled_region._depth and compiled_region.dynamo_runs_untraced()):
            return None
        state = _threads
        if not state.frames or state.frames[-1].module is not module:
            return None  # this call's enter() never ran (an earlier pre-hook raised)
        frame = state.frames.pop()
        _close(frame)
        if frame.boundary and output is not None:
            return map_tensors(output, to_fp32)
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
        """O2: in every module of ``module``'s subtree outside the modules kept in fp32, swap each floating
        parameter for its half copy (an op of the autograd graph where it trains), and show each floating buffer
        and each frozen parameter of a module class that is not one of torch's layers through a
        `aiak.amp.region_state.RegionState`."""
        state = _threads
        grad = torch.is_grad_enabled()
        versioned = not torch.is_inference_mode_enabled()  # inference tensors have no version counter
        copies = {}  # id(tensor) -> its copy: a tensor shared by two modules (tied weights) is cast once
        for m, kept, compiled in _walk(module):
            if id(m) in state.swapped:
                continue
            state.swapped.add(id(m))
            frame.modules.append(id(m))
            if kept:
                continue
            sparse = m.__dict__.get("sparse", False) is True  # nn.Embedding / EmbeddingBag(sparse=True)
            fp32 = _shows_fp32(m) and not compiled
            for name, p in m._parameters.items():
                if p is None or not p.is_floating_point() or p.dtype in HALF_DTYPES:
                    continue
                if fp32:
                    if grad and p.requires_grad and self.scaler is not None:
                        self._scaled(p)
                    self._show_state(frame, copies, m._parameters, name, p)
                    continue
                if compiled and is_state(m, p):
                    continue
                copy = copies.get(id(p))
                if copy is None:
                    copy = copies[id(p)] = self._param_copy(p, grad, sparse)
                frame.swapped.append((m._parameters, name, p, copy, copy._version if versioned else None,
                                      copy.data_ptr()))
                m._parameters[name] = copy
            for name, b in m._buffers.items():  # (left as they are in a compiled module: its region_call's autocast)
                if b is not None and b.is_floating_point() and b.dtype not in HALF_DTYPES and not compiled:
                    self._show_state(frame, copies, m._buffers, name, b)

    def _show_state(self, frame: _Frame, copies: dict, owner: dict, name: str, t: torch.Tensor) -> None:
        """``t`` (a buffer, or a frozen parameter of the model's own module) seen as the user's fp32 tensor."""
        seen = copies.get(id(t))
        if seen is None:
            seen = copies[id(t)] = RegionState.wrap(t, self.dtype)
        frame.swapped.append((owner, name, t, seen, None, t.data_ptr()))
        owner[name] = seen
        if not frame.shows_state:
            frame.shows_state = True
            region_opened()

    def _param_copy(self, p: torch.Tensor, grad: bool, sparse: bool) -> torch.Tensor:
        if grad and p.requires_grad and self.scaler is not None:
            self._scaled(p)
        return compute_copy(p, self.dtype, grad, sparse)

    def _scaled(self, p: torch.Tensor) -> None:
        """Hand a trainable parameter a region computes with in fp16 to root scaling (at a forward, not at install:
        a model that ``optimize()`` put back after a failure never computed in fp16, and stays unscaled)."""
        if id(p) not in self.registered:
            self.registered.add(id(p))
            root_scaling.register(p, self.scaler)

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.is_floating_point() else t

    def __repr__(self) -> str:
        return f"HalfCompute({self.level}, {self.dtype}, scaler={self.scaler!r})"


def _close(frame: _Frame) -> None:
    """Put back what ``frame`` swapped: each original in its slot; a parameter copy the forward edited in place
    written into the parameter; a buffer the forward reassigned stored in the buffer's own dtype."""
    for owner, name, original, seen, version, pointer in frame.swapped:
        current = owner.get(name)
        if current is seen:
            owner[name] = original
            if isinstance(seen, RegionState):
                if plain_pointer(seen) != pointer:  # ``.data`` of the user's tensor reassigned
                    with torch.no_grad():
                        original.data = unwrap(seen, original).data
            elif (version is not None and seen._version != version) or seen.data_ptr() != pointer:
                with torch.no_grad():  # (entered only here: it costs 2 us, as much as the rest of a tensor's close)
                    _write_back(original, seen)  # a half copy the forward (or a hook) edited in place or reassigned
        elif name in owner and isinstance(seen, RegionState) and not isinstance(original, nn.Parameter):
            owner[name] = unwrap(current, original)  # a buffer the forward reassigned
    _threads.swapped.difference_update(frame.modules)
    if frame.shows_state:
        frame.shows_state = False
        region_closed()
    if frame.autocast is not None:
        frame.autocast.__exit__(None, None, None)
        frame.autocast = None


def _write_back(original: torch.Tensor, edited: torch.Tensor) -> None:
    """A half copy the forward edited, written into the user's fp32 tensor: only the elements the edit changed
    (they differ from the original's half value) take the edited half value; the others keep their exact fp32
    value. A constraint applied every forward (``weight.clamp_(min=0)`` in a pre-hook) writes the clamped elements
    (exactly: 0) and leaves the rest unrounded, where copying the whole copy back rounded the whole weight to the
    half dtype at every forward and lost the optimizer's small updates."""
    if edited.shape != original.shape:
        original.copy_(edited)  # (a copy reassigned with another shape: copy_ says what is wrong)
        return
    changed = edited != original.to(edited.dtype)
    original.copy_(torch.where(changed, edited.to(original.dtype), original))


def close_to(depth: int) -> None:
    """Close every frame of this thread above ``depth`` (a forward left by an exception the hooks did not see)."""
    state = _threads
    while len(state.frames) > depth:
        _close(state.frames.pop())


class _CallGuard:
    """A hooked module's ``_call_impl`` (looked up on the instance by ``Module.__call__``): torch's own, inside a
    ``try`` that puts the originals back whatever ends the call: an exception, ``KeyboardInterrupt`` or
    ``SystemExit`` in a forward would leave the half copies in the model (torch's ``always_call`` forward hooks see an
    ``Exception`` only, and dynamo guards a traced call on their ids, one compilation per module). A call that fails for want of a half kernel (``torch.fft`` on a CPU) is run again with the module kept
    in fp32 (`aiak.amp.fp32_modules.keep_after_failure`)."""

    __slots__ = ("module", "compute")

    def __init__(self, module: nn.Module, compute: HalfCompute):
        self.module, self.compute = module, compute

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo traces the region into the graph
            return compiled_region.region_call(self.compute, self.module, args, kwargs, inside=bool(_threads.frames))
        if compiled_region.dynamo_runs_untraced():  # a frame of torch.compile that dynamo runs without tracing
            return compiled_region.region_call_untraced(self.compute, self.module, args, kwargs,
                                                        inside=bool(_threads.frames))
        module = called_module(self.module, sys._getframe(1))
        state = _threads
        depth = len(state.frames)
        try:
            if self._hooks_do_nothing(module, state):
                return module.forward(*args, **kwargs)
            return type(module)._call_impl(module, *args, **kwargs)
        except BaseException as error:
            close_to(depth)
            if self.compute.level == "O2" and keep_after_failure(module, error):
                _keep_fp32_now(module, self.compute)
                return module(*args, **kwargs)
            raise

    def _hooks_do_nothing(self, module: nn.Module, state: _ThreadState) -> bool:
        """``module`` is called inside a region that already computes it (O2: its tensors are swapped; O1: a region
        is open), and its only forward hooks are the region's: they would only record the call, so it runs as
        torch runs a module without hooks (``Module._call_impl``'s own shortcut). Each hooked module inside a
        region saves its two hook calls and torch's slow path, about 10 us per module call on this project's CPU."""
        if not (id(module) in state.swapped if self.compute.level == "O2" else state.frames):
            return False
        return (len(module._forward_pre_hooks) == 1 and len(module._forward_hooks) == 1
                and not (module._backward_hooks or module._backward_pre_hooks or _module_hooks._global_forward_hooks
                         or _module_hooks._global_forward_pre_hooks or _module_hooks._global_backward_hooks
                         or _module_hooks._global_backward_pre_hooks or torch._C._get_tracing_state()))


# One code object for every hooked module, and the hooks that stand aside in an untraced region: see compiled_region
for _fn in (_CallGuard.__call__, _CallGuard._hooks_do_nothing, HalfCompute.enter, HalfCompute.leave):
    compiled_region.never_a_frame(_fn)
del _fn


class _NotScriptable:
    """A hooked module's ``__prepare_scriptable__``, which ``torch.jit.script`` calls before compiling anything: it
    refuses with `_not_torchscript` (the region's hooks are Python that TorchScript cannot compile; it failed
    inside them with "Unknown type name 'nn.Module'")."""

    __slots__ = ("compute",)

    def __init__(self, compute: HalfCompute):
        self.compute = compute

    def __call__(self):
        raise RuntimeError(_not_torchscript("torch.jit.script", self.compute))


def _not_torchscript(what: str, compute: HalfCompute) -> str:
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute.dtype, str(compute.dtype))
    return (f"aiak: {what} cannot export a model that aiak.optimize() made compute in {compute.level} {dtype}: its "
            "half-precision regions are Python hooks TorchScript does not run. Use torch.export.export(model, "
            "args), which exports the optimized model, or get the plain model back: build it again and load this "
            "model's state_dict() into it (same keys, the same fp32 tensors), then script or trace that one")


def _state_dict_of_originals(module: nn.Module, destination, prefix: str, local_metadata) -> None:
    """``state_dict()`` taken while a region is open (in a forward hook, say): the user's tensors, not the
    compute copies."""
    if not _threads.frames:
        return
    for frame in _threads.frames:
        for owner, name, original, seen, *_ in frame.swapped:
            if (owner is module._parameters or owner is module._buffers) and prefix + name in destination:
                value = destination[prefix + name]
                destination[prefix + name] = original if value is seen else original.detach()


# -- which modules ----------------------------------------------------------------------------------

def _modules_of(model: nn.Module) -> Iterator[Tuple[nn.Module, bool]]:
    """``(module, kept in fp32?)`` for ``model`` and each of its submodules, once each (a module inside one kept
    in fp32 is kept too)."""
    for module, kept, _ in _walk(model):
        yield module, kept


def _walk(model: nn.Module) -> Iterator[Tuple[nn.Module, bool, bool]]:
    """``(module, kept in fp32?, inside a compiled module?)`` for ``model`` and each of its submodules, once each.
    A compiled module (``module.compile()``, or ``torch.compile(module)`` put in its parent's place) is traced by
    dynamo, which cannot trace a `aiak.amp.region_state.RegionState`."""
    seen: Set[int] = set()
    stack = [(model, False, False)]
    while stack:
        module, kept, compiled = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        kept = kept or is_kept_fp32(module)
        compiled = compiled or module.__dict__.get("_compiled_call_impl") is not None or "_orig_mod" in module._modules
        yield module, kept, compiled
        stack.extend((m, kept, compiled) for m in module._modules.values() if m is not None)


def _shows_fp32(module: nn.Module) -> bool:
    """O2 shows ``module``'s floating parameters as the user's fp32 tensors (`RegionState`, half only where they meet
    half tensors) rather than swapping them for half copies: those of a module class of the model's own, which its
    own ``forward`` may use with any op (``slogdet(self.weight)``, ``self.weight.data = renorm(...)``); the originals
    of a parametrization (``orthogonal``'s ``matrix_exp``); an embedding with ``max_norm``, which renormalizes the
    rows it looks up in place. torch's other layers, and the layers of other libraries in
    `aiak.amp.compiled_region.MATRIX_PRODUCT_LAYERS` (Hugging Face's ``Conv1D``), use their weights in matrix
    products and convolutions only: plain half copies, with no dispatch of their own."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return module.max_norm is not None
    return isinstance(module, parametrize.ParametrizationList) or not computes_as_torch_layer(module)


def _region_openers(model: nn.Module) -> List[nn.Module]:
    """The modules that open a region when called outside one: those that compute with a floating tensor of
    their subtree, outside the modules kept in fp32 and outside parametrizations (a parametrized weight read
    outside a forward is computed in fp32, as plain PyTorch does; inside a region it is computed from the
    region's copies)."""
    skip: Set[int] = set()
    openers = []
    for module, kept in _modules_of(model):
        if kept or id(module) in skip or isinstance(module, parametrize.ParametrizationList):
            skip.update(id(m) for m in module.modules())
            continue
        if _owns_floating(module):
            openers.append(module)
    return openers


def _owns_floating(module: nn.Module) -> bool:
    """The module or a submodule outside those kept in fp32 owns a floating parameter or buffer."""
    for m, kept in _modules_of(module):
        if kept:
            continue
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and t.is_floating_point():
                return True
    return False


def _keep_fp32_now(module: nn.Module, compute: HalfCompute) -> None:
    """``module`` has just been marked kept in fp32 in the middle of a region: its tensors back to the user's in
    every open frame, its region hooks off (it opens no region any more), the fp32 hooks on."""
    inside = {id(m._parameters) for m in module.modules()} | {id(m._buffers) for m in module.modules()}
    for frame in _threads.frames:
        for owner, name, original, seen, *_ in frame.swapped:
            if id(owner) in inside and owner.get(name) is seen:
                owner[name] = original
        frame.swapped = [entry for entry in frame.swapped if id(entry[0]) not in inside]
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(getattr(h, "__self__", None), HalfCompute)]:
                del hooks[key]
        vars(m).pop("_call_impl", None)
    hook_fp32_module(module, compute.dtype, compute.device_type)


def half_compute_of(model: nn.Module) -> Optional[HalfCompute]:
    """The `HalfCompute` hooked on ``model`` (or on the model a DDP wraps), if any."""
    model = getattr(model, "module", model)
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, HalfCompute):
            return owner
    return None
