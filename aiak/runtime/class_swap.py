"""A module computed another way, in place: its class swapped for a subclass with a mixin in front.

Module surgery (fused window attention, `aiak.ops.surgery`) and fp8 linear layers (`aiak.amp.fp8`)
change how a module computes without replacing the module: ``module.__class__`` becomes ``<Prefix><Name>``, a
subclass of the module's own class with the mixin's ``forward`` in front. Everything else stays: the parameters
(the same ``nn.Parameter`` objects, so an optimizer built before still holds the right tensors), buffers,
``state_dict`` keys, hooks registered on the module, attributes, ``isinstance`` checks against the original class.
Copies (``copy.deepcopy``: EMA, ``AveragedModel``) compute the same way. The swapped classes are registered in this
module under a qualname that encodes the mixin and the original class, so ``torch.save(model)`` of a whole model
loads in a process that never swapped anything.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional

from torch import nn

from aiak.runtime.marks import mark, marked

__all__ = ["swapped_class", "swap_class", "original_class", "restore_class"]

_CLASSES: Dict[str, type] = {}


def _encode(cls: type) -> str:
    # dots split a qualname when unpickling: the module path and qualname are written with slashes
    return f"{cls.__module__.replace('.', '/')}:{cls.__qualname__.replace('.', '/')}"


def _decode(text: str) -> type:
    module_path, qualname = text.split(":")
    found = importlib.import_module(module_path.replace("/", "."))
    for part in qualname.split("/"):
        found = getattr(found, part)
    return found


def swapped_class(original: type, mixin: type, prefix: str) -> type:
    """``<prefix><Name>``: ``mixin`` in front of ``original``, built once per pair and registered for pickling."""
    qualname = f"{prefix}:{_encode(mixin)}:{_encode(original)}"
    if qualname not in _CLASSES:
        cls = type(f"{prefix}{original.__name__}", (mixin, original), {"__doc__": original.__doc__})
        mark(cls, "_aiak_original_class", original)
        cls.__module__, cls.__qualname__ = __name__, qualname
        _CLASSES[qualname] = cls
    return _CLASSES[qualname]


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make ``module`` compute with ``mixin``'s forward, in place."""
    module.__class__ = swapped_class(type(module), mixin, prefix)


def original_class(module: nn.Module) -> Optional[type]:
    """The class ``module`` had before `swap_class`; None for a module never swapped."""
    return marked(type(module), "_aiak_original_class")


def restore_class(module: nn.Module) -> bool:
    """Undo `swap_class` on ``module``; returns whether it was swapped.

    A class made on top of the swapped one after the swap (torch's parametrizations make ``Parametrized<Name>``, a
    subclass holding the parametrized attributes as properties) is made again on top of the original class, with
    the same attributes, so the module keeps what was added after the swap."""
    original = original_class(module)
    if original is None:
        return False
    cls = type(module)
    if "_aiak_original_class" not in vars(cls):
        made_after = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
        original = type(cls.__name__, (original,), made_after)
    module.__class__ = original
    return True


def __getattr__(name: str):
    """Rebuilds a swapped class from its encoded qualname (unpickling in a process that swapped nothing)."""
    parts = name.split(":")
    if len(parts) == 5:
        prefix, mixin_module, mixin_name, original_module, original_name = parts
        return swapped_class(_decode(f"{original_module}:{original_name}"), _decode(f"{mixin_module}:{mixin_name}"),
                             prefix)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
