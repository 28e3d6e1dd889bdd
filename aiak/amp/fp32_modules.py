"""Which modules compute in fp32 under O2, and the hooks that give them fp32 inputs inside a half region.

apex's O2 keeps batch normalization in fp32; ``torch.autocast`` keeps the ops it lists in fp32 (softmax, losses,
``torch.fft`` on CUDA). aiak's O2 keeps, with their whole subtree, in fp32:

* normalization layers (`aiak.util.norm_layers.is_norm_layer`);
* the modules named by ``precision.keep_fp32`` (a class name, or a module path such as ``encoder.fourier``);
* a module whose forward failed for want of a half-precision kernel on the device (``torch.fft`` in bf16 on a
  CPU raises "Unsupported dtype BFloat16"): the region marks it, says so once, and runs the call again in fp32
  (`aiak.amp.half_compute`).

A kept module's inputs arrive in fp32 and its floating outputs leave in the region's dtype, when it is called
with half inputs; called with fp32 inputs (alone, or inside another kept module) it runs as plain PyTorch. Either
way autocast is off inside it: the region around it computes under autocast.
torch's BatchNorm, LayerNorm and GroupNorm take half inputs with fp32 weights natively and need no cast.
"""
from __future__ import annotations

import re
import sys
import threading
from typing import Iterable, List

import torch
from torch import nn

from aiak.util.config import StrategyError
from aiak.runtime.marks import mark, marked
from aiak.util.nested import iter_tensors, map_tensors
from aiak.util.norm_layers import is_norm_layer
from aiak.util.text import did_you_mean
from aiak.util.warn import warn_once

HALF_DTYPES = (torch.float16, torch.bfloat16)
_NO_HALF_KERNEL = re.compile(r"(not implemented for|[Uu]nsupported dtype|does not support).{0,40}"
                             r"(BFloat16|Half|bfloat16|float16)")


def is_kept_fp32(module: nn.Module) -> bool:
    return marked(module, "_aiak_keep_fp32", False) is True or is_norm_layer(module)


def modules_named(model: nn.Module, names: Iterable[str], key: str) -> List[nn.Module]:
    """The modules of ``model`` that ``names`` name (class names or module paths, as ``precision.keep_fp32`` and
    ``precision.fp8_skip`` take them); every name must match a module, else one `StrategyError` lists the
    names that match none under ``key``, with the choices."""
    paths = dict(model.named_modules())
    found, missing = [], []
    for name in names:
        hits = [paths[name]] if name in paths else [m for m in paths.values() if type(m).__name__ == name]
        if hits:
            found.extend(hits)
        else:
            missing.append(name)
    if missing:
        classes = sorted({type(m).__name__ for m in paths.values()})
        raise StrategyError([f"{key}: {name!r} is neither a module class of this model nor a module path"
                             f"{did_you_mean(name, classes + list(paths))}; classes here: {classes}"
                             for name in missing])
    return found


def keep_declared(model: nn.Module, names: Iterable[str], key: str = "precision.keep_fp32") -> List[nn.Module]:
    """Mark the modules of ``model`` that ``names`` name (`modules_named`) to compute in fp32."""
    found = modules_named(model, names, key)
    for module in found:
        mark(module, "_aiak_keep_fp32", True)
    return found


def no_half_kernel(error: BaseException) -> bool:
    """``error`` says an op has no kernel for the half dtype on this device."""
    return isinstance(error, (RuntimeError, NotImplementedError)) and bool(_NO_HALF_KERNEL.search(str(error)))


def keep_after_failure(module: nn.Module, error: BaseException) -> bool:
    """Mark ``module`` kept in fp32 after its forward raised ``error`` for want of a half kernel; says it once.
    False when it does not apply (another error, or already tried for this error by a module inside)."""
    if marked(error, "_aiak_fp32_tried", False) or not no_half_kernel(error) or is_kept_fp32(module):
        return False
    mark(error, "_aiak_fp32_tried", True)
    mark(module, "_aiak_keep_fp32", True)
    cls = type(module).__name__
    first = str(error).strip().splitlines()[0][:160]
    warn_once(f"keep-fp32-{cls}", f"aiak: O2 computes {cls} (and what it contains) in fp32: its forward has an op "
              f"with no half-precision kernel on this device ({first}). Name it in precision.keep_fp32 to say so "
              "up front")
    return True


class _Calls(threading.local):
    def __init__(self):
        self.cast_back: List[bool] = []


_calls = _Calls()


class Fp32Module:
    """The hooks of a module kept in fp32: half inputs cast to fp32, and then its fp32 outputs cast back; the
    module's instance ``_call_impl`` (`traced_call`) turns autocast off around them, which the region around it
    turns on. While dynamo traces the module (``torch.compile``), the hooks stand aside and `traced_call` does the
    casts too, in one traceable call."""

    __slots__ = ("dtype", "device_type", "module")

    def __init__(self, module: nn.Module, dtype: torch.dtype, device_type: str):
        self.module, self.dtype, self.device_type = module, dtype, device_type

    def enter(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        half = any(t.dtype in HALF_DTYPES for t in iter_tensors((args, kwargs)) if t.is_floating_point())
        _calls.cast_back.append(half)
        if not half:
            return None
        return map_tensors(args, _to_fp32), map_tensors(kwargs, _to_fp32)

    def leave(self, module, args, output):
        if torch.compiler.is_compiling() or not _calls.cast_back or not _calls.cast_back.pop():
            return None
        return map_tensors(output, self._to_half)

    def traced_call(self, *args, **kwargs):
        if not torch.compiler.is_compiling():  # (the hooks cast; autocast, which the region turns on, is off inside)
            module = called_module(self.module, sys._getframe(1))
            with torch.autocast(self.device_type, enabled=False):
                return type(module)._call_impl(module, *args, **kwargs)
        module = self.module
        if not any(t.dtype in HALF_DTYPES for t in iter_tensors((args, kwargs))):
            return type(module)._call_impl(module, *args, **kwargs)
        with torch.autocast(self.device_type, enabled=False):  # a traced O2 region runs under autocast
            out = type(module)._call_impl(module, *map_tensors(args, _to_fp32), **map_tensors(kwargs, _to_fp32))
        return map_tensors(out, self._to_half)

    def _to_half(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.dtype == torch.float32 else t


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in HALF_DTYPES else t


_WRAPPED_CALL = nn.Module._wrapped_call_impl.__code__  # Module.__call__, which looks _call_impl up on the instance


def called_module(module: nn.Module, caller) -> nn.Module:
    """The module an instance ``_call_impl`` installed on ``module`` was called for, from its caller's frame: a
    copy sharing ``module``'s ``__dict__`` (a DataParallel replica) calls it too."""
    if caller.f_code is _WRAPPED_CALL:
        return caller.f_locals.get("self", module)
    return module


def hook_fp32_module(module: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Give ``module`` the hooks of `Fp32Module` (once; not needed by torch's mixed-input norms)."""
    if isinstance(module, NATIVE_MIXED_NORMS):
        return
    for hook in module._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), Fp32Module):
            return
    keep = Fp32Module(module, dtype, device_type)
    module.register_forward_pre_hook(keep.enter, with_kwargs=True)
    module.register_forward_hook(keep.leave, always_call=True)
    vars(module)["_call_impl"] = keep.traced_call


# These accept a half input with fp32 weights natively (CPU and CUDA) and return the input's dtype.
NATIVE_MIXED_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
