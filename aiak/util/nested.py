"""Map a function over every tensor inside a nested batch or model output.

Handles tensors, lists, tuples, namedtuples, mappings (dict, OrderedDict, Hugging Face ``ModelOutput``)
and dataclasses; anything else is returned unchanged. Containers are rebuilt with their own type.

A dataclass is copied, not constructed again: every field is kept, ``field(init=False)`` ones included (their
tensors mapped too), and neither ``__init__`` nor ``__post_init__`` runs a second time, so a value computed
there is carried over as it was, not recomputed from the mapped fields, and a frozen dataclass works as well
(its fields are set with ``object.__setattr__``). A dataclass that is also a dict (Hugging Face's
``ModelOutput``, an ``OrderedDict``) keeps its keys in their order, each key the same object as its field.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable

import torch

_MISSING = object()


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # before Mapping: a ModelOutput is both
        return _map_dataclass(obj, fn)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _map_dataclass(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of the dataclass instance ``obj`` with every field mapped (``init=False`` ones too), made without
    calling ``__init__`` / ``__post_init__``."""
    mapped = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name, _MISSING)  # an init=False field nothing has set yet has no value
        if value is not _MISSING:
            mapped[f.name] = (value, map_tensors(value, fn))
    if isinstance(obj, dict):
        new = _copy_dict_dataclass(obj, mapped, fn)
    else:
        new = copy.copy(obj)
    for name, (_, value) in mapped.items():
        object.__setattr__(new, name, value)  # also on a frozen dataclass, and past a custom __setattr__
    return new


def _copy_dict_dataclass(obj: dict, mapped: dict, fn: Callable[[torch.Tensor], Any]) -> dict:
    """A dataclass that is also a dict (``ModelOutput``): a bare instance (``__new__`` only), its attributes, then
    its items in their order, set with the builtin dict's ``__setitem__`` (a ``ModelOutput`` forbids ``update``
    and mirrors keys into attributes); an item that is its field's value gets the field's mapped value."""
    cls = type(obj)
    new = cls.__new__(cls)
    state = getattr(obj, "__dict__", None)
    if state is not None:
        new.__dict__.update(state)
    setitem = OrderedDict.__setitem__ if isinstance(obj, OrderedDict) else dict.__setitem__
    items = OrderedDict.items(obj) if isinstance(obj, OrderedDict) else dict.items(obj)
    for key, value in items:
        field = mapped.get(key)
        setitem(new, key, field[1] if field is not None and field[0] is value else map_tensors(value, fn))
    return new


def iter_tensors(obj: Any):
    """Yield every tensor inside a nested structure (same traversal as `map_tensors`)."""
    found = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return iter(found)


def logits_of(output: Any) -> torch.Tensor:
    """The class scores in a model's output: the tensor itself, ``.logits`` (transformers), or the first
    element of a tuple (torchvision's Inception/GoogLeNet return ``(logits, aux_logits)`` in training)."""
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find class scores in a model output of type {type(output).__name__}")
