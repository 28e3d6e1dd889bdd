"""All or nothing: what ``optimize()`` may change is recorded first, and put back if it fails.

``optimize()`` changes the user's objects in place (module classes by surgery, parameter dtypes and layouts,
forward hooks, the optimizer's ``step`` and param groups, the scheduler's class) and a few process-wide
switches (TF32, cuDNN autotuning, CPU affinity, torch's thread count). A `Snapshot` taken before the
first change keeps *references* to everything those steps replace (each parameter's tensor, each module's
attribute dicts, the optimizer's groups); `Snapshot.restore` puts them back, in place, so that the
model, optimizer, scheduler and loader are exactly what the caller passed in: same classes, same tensors (so
the same values, dtypes and layouts), same hooks. Nothing is copied, so a snapshot costs no memory beyond
keeping the replaced tensors alive until ``optimize()`` returns.

What it cannot undo are in-place writes to the caller's own tensors and collectives already issued; the
steps before distributed wrapping make none (they build new tensors), and everything that can be checked
is validated before the first change (``aiak.strategy``).
"""
from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch import nn

from aiak.runtime.switches import read_switches, write_switches

_CONTAINERS = (dict, list)


class _ObjectState:
    """An object's class and attribute dict, plus the contents of the dicts and lists it holds (one level:
    hook dicts, ``_parameters``, ``_buffers``, optimizer ``state`` and ``param_groups``)."""

    __slots__ = ("obj", "cls", "attrs", "contents")

    def __init__(self, obj: Any):
        self.obj = obj
        self.cls = type(obj)
        self.attrs = dict(vars(obj))
        self.contents: List[Tuple[Any, Any]] = [(v, _copy(v)) for v in self.attrs.values() if isinstance(v, _CONTAINERS)]

    def restore(self) -> None:
        if type(self.obj) is not self.cls:
            self.obj.__class__ = self.cls
        vars(self.obj).clear()
        vars(self.obj).update(self.attrs)
        for container, saved in self.contents:  # the same container objects, so handles held elsewhere still work
            _refill(container, saved)


def _copy(container):
    return dict(container) if isinstance(container, dict) else list(container)


def _refill(container, saved) -> None:
    container.clear()
    if isinstance(container, dict):
        container.update(saved)
    else:
        container.extend(saved)


class _TensorState:
    """A parameter's (or buffer's) tensor, gradient and ``requires_grad``."""

    __slots__ = ("tensor", "data", "grad", "requires_grad")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.data = tensor.data
        self.grad = tensor.grad
        self.requires_grad = tensor.requires_grad

    def restore(self) -> None:
        with torch.no_grad():
            self.tensor.data = self.data
            self.tensor.grad = self.grad
        if self.tensor.is_leaf:
            self.tensor.requires_grad_(self.requires_grad)


class Snapshot:
    """Everything ``optimize()`` may change in ``objects`` (modules, optimizer, scheduler, loader) and in the
    process; `restore` puts it back. Take it before the first change."""

    def __init__(self, *objects: Any):
        self._objects: List[_ObjectState] = []
        self._tensors: List[_TensorState] = []
        seen = set()
        for obj in objects:
            for part in _parts(obj):
                if id(part) not in seen and hasattr(part, "__dict__"):
                    seen.add(id(part))
                    self._objects.append(_ObjectState(part))
            if isinstance(obj, nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    if id(t) not in seen:
                        seen.add(id(t))
                        self._tensors.append(_TensorState(t))
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    self._objects.append(_DictState(group))
                for state in obj.state.values():   # a resumed optimizer's state: channels_last lays it out
                    for t in state.values() if isinstance(state, dict) else ():
                        if isinstance(t, torch.Tensor) and id(t) not in seen:
                            seen.add(id(t))
                            self._tensors.append(_TensorState(t))
        self._switches = read_switches()

    def restore(self) -> None:
        for state in self._objects:
            state.restore()
        for state in self._tensors:
            state.restore()
        write_switches(self._switches)


class _DictState:
    """A dict whose identity matters (an optimizer param group: schedulers hold the list of them)."""

    __slots__ = ("obj", "saved")

    def __init__(self, obj: dict):
        self.obj, self.saved = obj, dict(obj)

    def restore(self) -> None:
        _refill(self.obj, self.saved)


def _parts(obj: Any) -> List[Any]:
    """The objects whose attributes ``optimize()`` may change: every submodule of a model; an optimizer; a
    scheduler; a loader with its sampler and batch sampler."""
    if obj is None:
        return []
    if isinstance(obj, nn.Module):
        return list(obj.modules())
    parts = [obj]
    for name in ("sampler", "batch_sampler"):
        part = vars(obj).get(name) if hasattr(obj, "__dict__") else None
        if part is not None:
            parts.append(part)
    return parts
