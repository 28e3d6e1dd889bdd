"""Nested mappings addressed by dotted key paths (``"precision.level"``), as strategies and their YAML are."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Tuple


def leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """``(dotted path, value)`` of every leaf: mappings are walked, lists and scalars are leaves."""
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def key_paths(data: Mapping[str, Any], prefix: str = "") -> List[str]:
    """Dotted paths of every key, sections and the keys inside them."""
    paths = []
    for key, value in data.items():
        paths.append(f"{prefix}{key}")
        if isinstance(value, Mapping):
            paths.extend(key_paths(value, f"{prefix}{key}."))
    return paths


def put_leaf(tree: Dict[str, Any], path: str, value: Any) -> None:
    """Set ``path`` in ``tree``, making the sections on the way."""
    *sections, key = path.split(".")
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[key] = value


def get_leaf(tree: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """The value at ``path`` in ``tree``, or ``default`` where a key on the way is missing."""
    for key in path.split("."):
        if not isinstance(tree, Mapping) or key not in tree:
            return default
        tree = tree[key]
    return tree
