"""Map a function over every tensor inside a nested batch or model output.

Handles tensors, lists, tuples, namedtuples, mappings (dict, OrderedDict, Hugging Face ``ModelOutput``)
and dataclasses; anything else is returned unchanged. Containers are rebuilt with their own type.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Return ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
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


def iter_tensors(obj: Any):
    """Yield every tensor inside a nested structure (same traversal as :func:`map_tensors`)."""
    found = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return iter(found)
