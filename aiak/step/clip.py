"""torch's gradient clipping, made right for parameters aiak optimized: "your loop, unchanged".

A loop that calls ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on every ``step()`` call
would, under aiak's gradient accumulation, clip partial sums on every micro-step (and the sum of the window
instead of its average on the last). So aiak patches torch's functions; when the parameters (or gradients)
given belong to an optimizer aiak patched, the call is handed to that optimizer's step controller
(``aiak.step.controller.StepController``, the one implementation), which clips the true gradient of the
real step: the window's average, unscaled (fp16 loss scaling is undone as each gradient lands, see
`aiak.amp.scaling.root_scaling`). On a micro-step it clips nothing, and a norm it returns is the norm accumulated
so far in the window, in the real step's units (finite, for a loop that logs ``norm.item()`` every
iteration). Every other call is torch's original function, with the same arguments.

Patched names (torch 2.14, ``torch/nn/utils/clip_grad.py``):

* ``torch.nn.utils.clip_grad_norm_``, ``clip_grad_value_``, ``get_total_norm``, ``clip_grads_with_norm_``
  and the same functions in ``torch.nn.utils.clip_grad`` (``clip_grad_norm``, deprecated, calls
  ``clip_grad_norm_`` from there);
* the helpers that torch's own ``clip_grad_norm_`` looks up at call time (``_get_total_norm``,
  ``_clip_grads_with_norm_``), so that a ``clip_grad_norm_`` imported *before* ``aiak.optimize()``
  (``from torch.nn.utils import clip_grad_norm_``) is right too; likewise ``clip_grad_value_`` through
  ``_group_tensors_by_device_and_dtype``, which only routes when torch's ``clip_grad_value_`` asks.
* ``get_total_norm`` / ``clip_grads_with_norm_`` imported before ``optimize()`` cannot be routed (each is
  handed gradients, not parameters, and would see a window's partial sum): a call of them on an aiak
  model's gradients warns once, saying what to call instead.

Clip functions of other libraries that read ``.grad`` themselves are routed the same way where aiak knows them
(`ELEMENTWISE_CLIPS`: timm's adaptive gradient clipping, Brock et al. 2021, "High-Performance Large-Scale
Image Recognition Without Normalization", section 3, which timm's ``dispatch_clip_grad(..., mode="agc")`` calls):
on a real step they run on the real step's gradients, on a micro-step not at all. They are patched in their
modules when aiak routes (timm imported first, as every timm script does). One bound by name before that, or a
library aiak does not know, edits the partial sums; the step controller notices a gradient changed in place
between ``backward()`` and a micro-step's ``step()`` and says so once.

All of these are the ``clip`` patch of `aiak.runtime.patches`: ``aiak.undo_patches()`` puts torch's and
timm's functions back and forgets the step controllers routed to.

Parameters of an aiak optimizer mixed in one call with other parameters that have gradients (or with a
second aiak optimizer's) cannot be attributed to one real step: torch's function runs unchanged on the
gradients as they are, and a warning (once) says to clip each optimizer's parameters separately.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_grad

from aiak.runtime import patches
from aiak.util.warn import warn_once

# torch's functions as they were when aiak was imported: what every call not routed to aiak runs.
ORIGINALS: Dict[str, Any] = {
    "clip_grad_norm_": _clip_grad.clip_grad_norm_,
    "clip_grad_value_": _clip_grad.clip_grad_value_,
    "get_total_norm": _clip_grad._get_total_norm,
    "clip_grads_with_norm_": _clip_grad._clip_grads_with_norm_,
    "group_by_device_and_dtype": getattr(_clip_grad, "_group_tensors_by_device_and_dtype", None),
}

_owners: "weakref.WeakSet[Any]" = weakref.WeakSet()
_state = threading.local()  # .depth > 0 while aiak itself calls torch's originals


def route_to(owner) -> None:
    """Send clip calls on ``owner``'s parameters to it (installing the patch on first use).

    ``owner`` (a ``StepController``) provides ``active()``, ``clip_targets()`` (pairs of a tensor a user
    may pass and the tensor the real step uses for it), and ``grad_norm``, ``clip_grads_with_norm_``,
    ``clip_grad_norm_``, ``clip_grad_value_`` and ``real_step_grads``, which take the real step's tensors.
    It is held weakly.
    """
    _install()
    _owners.add(owner)


def call_original(name: str, *args, **kwargs):
    """torch's original ``name`` (a key of `ORIGINALS`), with routing off for what it calls."""
    with _passthrough():
        return ORIGINALS[name](*args, **kwargs)


@contextlib.contextmanager
def _passthrough() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _routing() -> bool:
    return getattr(_state, "depth", 0) == 0 and len(_owners) > 0


# -- which owner, if any, a call belongs to ---------------------------------------------------------

def _live_owners() -> List[Any]:
    return [o for o in list(_owners) if o.active()]


def _owner_of(tensors: List[torch.Tensor], fn: str, *, as_grads: bool) -> Optional[Tuple[Any, List[torch.Tensor]]]:
    """``(owner, tensors its real step uses for them)`` if every tensor given that matters belongs to one
    owner, else None.

    ``as_grads``: the tensors are gradients (``get_total_norm``); they are matched to the parameters whose
    ``.grad`` they are. Otherwise they are parameters; a foreign one without a gradient does not matter.
    """
    owned: Dict[int, Tuple[Any, torch.Tensor]] = {}  # id(parameter), or id(its gradient) -> (owner, step tensor)
    for owner in _live_owners():
        for user_side, step_side in owner.clip_targets():
            for t in (user_side, step_side):
                if not as_grads:
                    owned[id(t)] = (owner, step_side)
                elif t.grad is not None:
                    owned[id(t.grad)] = (owner, step_side)
    if not owned:
        return None
    found, chosen, stray = None, {}, False
    for t in tensors:
        match = owned.get(id(t))
        if match is None:
            stray = stray or as_grads or t.grad is not None
        elif found is None or match[0] is found:
            found = match[0]
            chosen[id(match[1])] = match[1]  # each once
        else:
            stray = True
    if found is None:
        return None
    if stray:
        warn_once("clip-mixed", f"aiak: {fn if '.' in fn else 'torch.nn.utils.' + fn} got parameters of an aiak-optimized model together with "
                  "other parameters that have gradients (or another aiak optimizer's): aiak cannot tell which "
                  "real step they belong to, so torch's function ran on the gradients as they are (loss-scaled, "
                  "partial sums under accumulation). Clip each optimizer's parameters in its own call, e.g. "
                  "aiak.clip_grad_norm_(optimizer, max_norm).")
        return None
    return found, list(chosen.values())


def _as_list(parameters, *, warn_empty_generator: bool) -> List[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if warn_empty_generator and is_generator and not parameters:  # what torch's clip_grad_norm_ says
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    return parameters


# -- the patched functions (same signatures as torch 2.14's) ----------------------------------------

def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, or, on an aiak-optimized model's parameters, its step controller's."""
    params = _as_list(parameters, warn_empty_generator=True)
    found = _owner_of(params, "clip_grad_norm_", as_grads=False) if _routing() else None
    if found is None:
        return call_original("clip_grad_norm_", params, max_norm, norm_type, error_if_nonfinite, foreach)
    owner, owned = found
    return owner.clip_grad_norm_(max_norm, norm_type, tensors=owned, error_if_nonfinite=error_if_nonfinite,
                                 foreach=foreach)


def clip_grad_value_(parameters, clip_value: float, foreach: Optional[bool] = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, or, on an aiak-optimized model's parameters, its step controller's."""
    params = _as_list(parameters, warn_empty_generator=False)
    found = _owner_of(params, "clip_grad_value_", as_grads=False) if _routing() else None
    if found is None:
        return call_original("clip_grad_value_", params, clip_value, foreach)
    owner, owned = found
    return owner.clip_grad_value_(clip_value, tensors=owned, foreach=foreach)


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``; on an aiak-optimized model's gradients, the true norm of its real step."""
    grads = _as_list(tensors, warn_empty_generator=False)
    found = _owner_of(grads, "get_total_norm", as_grads=True) if _routing() else None
    if found is None:
        return call_original("get_total_norm", grads, norm_type, error_if_nonfinite, foreach)
    owner, params = found
    return owner.grad_norm(params, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


def clip_grads_with_norm_(parameters, max_norm: float, total_norm: torch.Tensor,
                          foreach: Optional[bool] = None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``; on an aiak-optimized model, scales its real step's gradients."""
    params = _as_list(parameters, warn_empty_generator=False)
    found = _owner_of(params, "clip_grads_with_norm_", as_grads=False) if _routing() else None
    if found is None:
        return call_original("clip_grads_with_norm_", params, max_norm, total_norm, foreach)
    owner, owned = found
    return owner.clip_grads_with_norm_(owned, max_norm, total_norm, foreach=foreach)


def _code_of(fn) -> Optional[types.CodeType]:
    return getattr(inspect.unwrap(fn), "__code__", None)


_CLIP_VALUE_CODE = _code_of(ORIGINALS["clip_grad_value_"])
_TWO_STEP_CODES = {_code_of(ORIGINALS["get_total_norm"]), _code_of(ORIGINALS["clip_grads_with_norm_"])}


def _group_by_device_and_dtype(tensorlistlist, *args, **kwargs):
    """torch's grouping helper, as seen by clip_grad.py: routes a ``clip_grad_value_`` bound before optimize().

    torch's ``clip_grad_value_`` groups ``[p.grad for p in parameters]`` and clamps what comes back; for an
    aiak model's gradients it gets the real step's gradients instead (none on a micro-step).
    """
    original = ORIGINALS["group_by_device_and_dtype"]
    caller = sys._getframe(1).f_code
    if not _routing() or (caller is not _CLIP_VALUE_CODE and caller not in _TWO_STEP_CODES):
        return original(tensorlistlist, *args, **kwargs)
    grads = [g for g in tensorlistlist[0] if g is not None]
    fn = "clip_grad_value_" if caller is _CLIP_VALUE_CODE else "get_total_norm / clip_grads_with_norm_"
    found = _owner_of(grads, fn, as_grads=True) if grads else None
    if found is None:
        return original(tensorlistlist, *args, **kwargs)
    owner, params = found
    if caller is not _CLIP_VALUE_CODE:
        warn_once("clip-two-step-held", "aiak: torch.nn.utils.get_total_norm / clip_grads_with_norm_ bound before "
                  "aiak.optimize() ran on an aiak-optimized model's gradients: those are torch's originals, which "
                  "see a gradient-accumulation window's partial sum. Call them through the module (torch.nn.utils.get_total_norm"
                  "(...)), import them after optimize(), or use torch.nn.utils.clip_grad_norm_.")
        return original(tensorlistlist, *args, **kwargs)
    with _passthrough():
        step_grads = owner.real_step_grads(params)
        return original([step_grads], *args, **kwargs) if step_grads else {}


# Per-parameter clip functions of other libraries, ``(module, name)``, taking ``(parameters, *args)`` and
# editing each ``p.grad`` from ``p`` and ``p.grad`` alone: run as they are on the real step's gradients.
ELEMENTWISE_CLIPS = (("timm.utils.agc", "adaptive_clip_grad"), ("timm.utils.clip_grad", "adaptive_clip_grad"),
                     ("timm.utils", "adaptive_clip_grad"))


def _real_step_only(original, name: str):
    """``original`` (an elementwise clip of another library) routed: on an aiak optimizer's parameters it runs on
    the real step's gradients (averaged over the window, unscaled) and does nothing on a micro-step."""
    def clip(parameters, *args, **kwargs):
        params = _as_list(parameters, warn_empty_generator=False)
        found = _owner_of(params, name, as_grads=False) if _routing() else None
        if found is None:
            return original(params, *args, **kwargs)
        owner, owned = found
        if not owner.real_step_grads(owned):
            return None  # a micro-step, or an overflow the step will skip
        with _passthrough():
            return original(owned, *args, **kwargs)

    clip.__wrapped__ = original
    clip.__doc__ = original.__doc__
    return clip


def _install_elementwise_clips() -> None:
    """Patch the known clip functions of libraries already imported (each once)."""
    routed: Dict[int, Any] = {}
    for module_name, name in ELEMENTWISE_CLIPS:
        module = sys.modules.get(module_name)
        original = getattr(module, name, None) if module is not None else None
        if original is None or patches.is_replacement(original):
            continue
        if id(original) not in routed:
            routed[id(original)] = _real_step_only(original, f"{module_name}.{name}")
        patches.replace("clip", module, name, routed[id(original)])


def _install() -> None:
    if not patches.installed("clip"):
        for module in (torch.nn.utils, _clip_grad):
            patches.replace("clip", module, "clip_grad_norm_", clip_grad_norm_)
            patches.replace("clip", module, "clip_grad_value_", clip_grad_value_)
        patches.replace("clip", torch.nn.utils, "get_total_norm", get_total_norm)
        patches.replace("clip", torch.nn.utils, "clip_grads_with_norm_", clip_grads_with_norm_)
        patches.replace("clip", _clip_grad, "_get_total_norm", get_total_norm)
        patches.replace("clip", _clip_grad, "_clip_grads_with_norm_", clip_grads_with_norm_)
        if ORIGINALS["group_by_device_and_dtype"] is not None and _CLIP_VALUE_CODE is not None:
            patches.replace("clip", _clip_grad, "_group_tensors_by_device_and_dtype", _group_by_device_and_dtype)
        patches.on_undo("clip", _owners.clear)
    _install_elementwise_clips()
