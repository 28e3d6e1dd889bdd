"""Built-in YAML profiles and ``load_strategy``: name, YAML path or dict -> validated ``Strategy``.

Profiles live in the top-level ``configs/`` folder of a source checkout and ship inside the wheel as the
package ``aiak.configs``; both places are searched. ``extends: <name or path>`` inherits another profile:
the parent is loaded (recursively), then the child's keys override it section by section.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from aiak.strategy.schema import Strategy, StrategyError


def profiles_dir() -> Path:
    """The folder holding the built-in profiles (installed wheel first, then the source checkout)."""
    here = Path(__file__).resolve().parent.parent  # .../aiak
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "default.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"aiak's built-in profiles were not found next to {here} (broken install?)")


def list_profiles() -> List[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def _read_yaml(path: Path) -> Dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise StrategyError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise StrategyError(f"{path}: a strategy file must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _locate(name_or_path: str, relative_to: Optional[Path] = None) -> Path:
    """A built-in profile name, or a YAML path (relative paths also tried beside the extending file)."""
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        candidates = [Path(name_or_path)]
        if relative_to is not None and not Path(name_or_path).is_absolute():
            candidates.insert(0, relative_to.parent / name_or_path)
        for c in candidates:
            if c.is_file():
                return c
        raise StrategyError(f"strategy file {name_or_path!r} not found")
    path = profiles_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        import difflib

        names = list_profiles()
        close = difflib.get_close_matches(name_or_path, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise StrategyError(f"strategy: unknown profile {name_or_path!r}{hint}; built-in profiles: {names}, "
                            f"or give a path to a .yaml file or a dict")
    return path


def _merge(parent: Mapping[str, Any], child: Mapping[str, Any]) -> Dict[str, Any]:
    """Child over parent; mapping sections merge key by key, everything else is replaced."""
    out = dict(parent)
    for key, value in child.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve_extends(data: Mapping[str, Any], source: str, path: Optional[Path], seen: List[str]) -> Dict[str, Any]:
    parent_ref = data.get("extends")
    if parent_ref is None:
        return dict(data)
    if not isinstance(parent_ref, str):
        raise StrategyError(f"{source}: extends must be a profile name or a YAML path, got {parent_ref!r}")
    parent_path = _locate(parent_ref, relative_to=path)
    key = str(parent_path.resolve())
    if key in seen:
        raise StrategyError(f"{source}: extends: cycle through {parent_ref!r}")
    parent = _resolve_extends(_read_yaml(parent_path), str(parent_path), parent_path, seen + [key])
    parent.pop("name", None)
    parent.pop("description", None)
    parent.pop("match", None)  # match conditions are the profile's own, never inherited
    return _merge(parent, data)


def load_strategy(spec: Union[str, os.PathLike, Mapping[str, Any], Strategy]) -> Strategy:
    """Built-in profile name, YAML path, dict (same shape as the YAML) or ``Strategy`` -> ``Strategy``."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, Mapping):
        merged = _resolve_extends(spec, "<dict>", None, [])
        return Strategy.from_dict(merged, source="<dict>")
    if not isinstance(spec, (str, os.PathLike)):
        raise StrategyError(f"strategy must be a profile name, a YAML path, a dict or an aiak.Strategy, "
                            f"got {type(spec).__name__}")
    path = _locate(os.fspath(spec))
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    merged = _resolve_extends(data, str(path), path, [str(path.resolve())])
    return Strategy.from_dict(merged, source=str(path))
