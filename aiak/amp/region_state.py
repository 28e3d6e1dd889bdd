"""The user's fp32 tensors inside an O2 region: still the user's tensor, seen in half only where half tensors meet
it.

apex's O2 casts a model's buffers and parameters to half. A buffer is often state rather than a weight: a counter
(``self.seen += n``), a running average updated in ``forward`` under ``no_grad``, a value reassigned each call
(``self.total = self.total + x.sum()``); so is a frozen parameter of a model's own module class, such as a VQ-VAE's
codebook moved by an exponential average inside ``forward``. In half, a counter stops at 256 in bf16, a reassigned
buffer turns bf16 for good and an average is rounded at every update. A parameter a model's own module uses in its
``forward`` may meet any op: ``torch.slogdet(self.weight)`` (Glow), ``matrix_exp`` of a generator (an orthogonal
parametrization), ``self.weight.data = torch.renorm(...)`` (EEGNet's max-norm constraint); in half these raise,
return inf, or edit a copy that is thrown away. So inside an O2 region (`aiak.amp.half_compute`) each floating
buffer outside the modules kept in fp32, each parameter owned directly by a module whose class is not one of
``torch.nn``'s layers (nor a layer known to compute as one, such as Hugging Face's ``Conv1D``), the originals of a parametrization and an embedding table with ``max_norm`` are the user's
tensor itself, seen through `RegionState`, a view that shares its memory, version counter and autograd
history; ``__torch_function__`` decides per operation:

* an in-place operation on it (``add_``, ``+=``, ``copy_``, ``buf[i] = v``, ``out=buf``, ``t.data = v``) runs on the
  fp32 tensor: fp32 arithmetic, exact for integer-valued counters, the update lands in the user's tensor;
* an explicit conversion (``.float()``, ``.to(x.dtype)``, ``.type_as(x)``) gives what it asks for, as a plain
  tensor;
* an operation that also takes half tensors with dimensions sees it in the region's half dtype, as apex's O2 would
  (``x + self.pos_table``, ``F.linear(x, self.weight)``, ``torch.cat((self.cls_token, x))``): the result is a plain
  tensor; except where autocast, which the region runs under, runs the operation in fp32 (``torch.cdist(z,
  self.codebook)`` on a CPU, ``layer_norm`` on CUDA: `aiak.amp.autocast_policy` asks torch): it gets the fp32
  value, not a rounded copy;
* an operation on such tensors alone, or beside fp32 tensors and 0-dimensional ones (``self.seen + n``,
  ``self.table[:, :t]``, ``slogdet(self.weight)``, ``mask * self.weight``), runs in fp32, as plain PyTorch would
  on the fp32 parameter, and its floating result is again a `RegionState`, so a buffer reassigned from it
  keeps its fp32 value and a weight computed from it meets half tensors in half.

These tensors are few and used by few operations, so the Python dispatch costs little; the weights of torch's own
layers (a frozen backbone's convolutions, a LoRA model's base ``Linear`` layers) are plain half copies, with no
dispatch of their own. When the region closes, a buffer the forward reassigned is stored back as a plain tensor in
the buffer's own dtype, and a tensor whose ``.data`` the forward reassigned takes that value. A value the forward
kept elsewhere (``self.last = self.total.clone()``) outlives the region as a `RegionState`: outside every
region it computes as the plain fp32 tensor it is.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from aiak.amp.autocast_policy import runs_in_fp32

_CONVERSIONS = frozenset({"to", "float", "double", "half", "bfloat16", "type", "type_as"})
_HALF = (torch.float16, torch.bfloat16)


class _Open(threading.local):
    count = 0   # regions of this thread that show state as RegionState (`aiak.amp.half_compute`)


_open = _Open()


def region_opened() -> None:
    _open.count += 1


def region_closed() -> None:
    _open.count = max(_open.count - 1, 0)


def _mutates_first(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__setitem__", "__set__") or name.startswith("__i"):  # (``__set__``: ``t.data = v``)
        return True
    return name.endswith("_") and not name.startswith("_")


class RegionState(torch.Tensor):
    """The user's fp32 buffer or parameter inside an O2 region (see the module docstring); ``_half``: the
    region's dtype."""

    _half: torch.dtype

    @staticmethod
    def wrap(t: torch.Tensor, half: torch.dtype) -> "RegionState":
        """``t`` seen as a `RegionState` (a `RegionParameter` for a parameter)."""
        with torch._C.DisableTorchFunctionSubclass():
            out = t.as_subclass(RegionParameter if isinstance(t, nn.Parameter) else RegionState)
        out._half = half
        return out

    def half_copy(self) -> torch.Tensor:
        """This tensor in the region's half dtype, a plain tensor made once per region and reused while the user's
        tensor is unchanged (its version) and gradients are recorded or not as when it was made: a weight a forward
        uses T times (a recurrent cell's) is cast once, as the region's half copies of torch's layers are. Called
        with subclass dispatch off. A tensor made under ``inference_mode`` has no version counter: cast at each use."""
        if self.is_inference():
            return self.as_subclass(torch.Tensor).to(self._half)
        key = (self._version, torch.is_grad_enabled())
        kept = self.__dict__.get("_half_copy")
        if kept is None or kept[0] != key:
            kept = self.__dict__["_half_copy"] = (key, self.as_subclass(torch.Tensor).to(self._half))
        return kept[1]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _flat(args, kwargs)
        tensors = [t for t in (flat if flat is not None else tree_flatten((args, kwargs))[0])
                   if isinstance(t, torch.Tensor)]
        state = next(t for t in tensors if isinstance(t, RegionState))
        half = state._half
        # (a method of a RegionState called here, outside the DisableTorchFunctionSubclass below, would recurse)
        others = any(not isinstance(t, RegionState) and t.dtype in _HALF and t.dim() for t in tensors)
        name = getattr(func, "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            if not _open.count:                                    # outside every region: a plain fp32 tensor
                return tree_map(_plain, func(*args, **kwargs))
            if isinstance(kwargs.get("out"), RegionState) or (
                    args and isinstance(args[0], RegionState) and _mutates_first(func)):
                return func(*args, **kwargs)                       # fp32, in the user's tensor
            if name in _CONVERSIONS or others:
                device = state.device.type
                fp32 = name in _CONVERSIONS or (torch.is_autocast_enabled(device) and
                                                runs_in_fp32(func, args, kwargs, device, half))

                def as_plain(t):
                    if not isinstance(t, RegionState):
                        return t
                    return t.as_subclass(torch.Tensor) if fp32 else t.half_copy()
                if flat is not None:
                    return func(*[as_plain(a) for a in args])
                return func(*tree_map(as_plain, args), **tree_map(as_plain, kwargs))
            result = func(*args, **kwargs)                          # region state alone: fp32, and stays so
        return tree_map(lambda t: cls.wrap(t, half) if _keeps(t) else _plain(t), result)


class RegionParameter(RegionState, nn.Parameter):
    """A parameter inside an O2 region: a `RegionState` that is still an ``nn.Parameter``, so ``self.steps +=
    1`` (which assigns the result back to the attribute) is accepted by ``Module.__setattr__``."""


def _flat(args: tuple, kwargs: dict):
    """``args`` when the call has no keyword argument and no container among its arguments (``addmm(b, x,
    self.weight)``, the common call), else None: the arguments are then walked directly instead of through
    ``torch.utils._pytree``, which cost about 35 us per call, as much again as a small matrix product."""
    if kwargs:
        return None
    for a in args:
        if isinstance(a, (list, tuple, dict)):
            return None
    return args


def _keeps(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in _HALF


def _plain(t: Any) -> Any:
    if isinstance(t, RegionState):
        with torch._C.DisableTorchFunctionSubclass():
            return t.as_subclass(torch.Tensor)
    return t


def unwrap(t: Any, like: torch.Tensor) -> Any:
    """A value a forward left in a buffer's slot, as a plain tensor in the dtype of the buffer ``like`` it
    replaced."""
    if not isinstance(t, torch.Tensor):
        return t
    plain = _plain(t)
    if plain.is_floating_point() and plain.dtype != like.dtype:
        with torch.no_grad():
            plain = plain.to(like.dtype)
    return plain


def plain_pointer(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s memory (a ``.data = ...`` inside a forward moves it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.data_ptr()
