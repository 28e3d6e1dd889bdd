"""Profile files: where they are, how they are read, and how an ``extends:`` chain merges into one mapping.

Built-in profiles live in the top-level ``configs/`` folder of a source checkout and ship inside the wheel as
the package ``aiak.configs``; both places are searched. User profiles live in the folders of the search path
(`user_profile_dirs`): those of ``AIAK_PROFILE_PATH`` (``os.pathsep``-separated, in order), then
``~/.config/aiak/profiles/``. A name is looked up among the built-ins first, then in those folders in order.
``extends: <name or path>`` inherits another profile: the parent is loaded (recursively), then the child's
keys override it section by section. Nothing here validates a key: `aiak.strategy.schema` does.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from aiak.util.config import StrategyError
from aiak.strategy.key_paths import key_paths
from aiak.util.text import did_you_mean
from aiak.util.warn import warn_once

PROFILE_PATH_ENV = "AIAK_PROFILE_PATH"
USER_PROFILE_DIR = Path("~/.config/aiak/profiles")


def profiles_dir() -> Path:
    """The folder holding the built-in profiles (installed wheel first, then the source checkout)."""
    here = Path(__file__).resolve().parent.parent  # .../aiak
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "default.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"aiak's built-in profiles were not found next to {here} (broken install?)")


def user_profile_dirs() -> List[Path]:
    """The user profile folders, in search order: ``AIAK_PROFILE_PATH``'s, then ``~/.config/aiak/profiles/``."""
    listed = [Path(p).expanduser() for p in os.environ.get(PROFILE_PATH_ENV, "").split(os.pathsep) if p]
    return listed + [USER_PROFILE_DIR.expanduser()]


def _yaml_files(folder: Path) -> List[Path]:
    """The ``*.yaml`` / ``*.yml`` files of ``folder``, sorted by name; none when it does not exist."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


@dataclass(frozen=True)
class ProfileFile:
    """One profile file in evaluation order. ``name`` is its file name without the suffix, or its path when a
    profile found earlier (a built-in first) has that name, since only the first one loads by name."""

    name: str
    path: Path
    builtin: bool


def profile_files() -> List[ProfileFile]:
    """Every profile the auto-selector evaluates, in its order: the built-ins sorted by name, then each user
    folder of `user_profile_dirs` in turn, sorted by name."""
    found = [ProfileFile(p.stem, p, True) for p in _yaml_files(profiles_dir())]
    names = {f.name for f in found}
    for folder in user_profile_dirs():
        for path in _yaml_files(folder):
            found.append(ProfileFile(str(path) if path.stem in names else path.stem, path, False))
            names.add(path.stem)
    return found


def list_profiles(user: bool = True) -> List[str]:
    """Names ``load_strategy`` accepts: the built-in profiles and (``user``) those of the user folders, sorted."""
    return sorted(f.name for f in profile_files() if (f.builtin or user) and f.name == f.path.stem)


def _yaml_loader():
    """PyYAML's safe loader, reading numbers as YAML 1.2 does; its LibYAML parser where PyYAML was built with it
    (parsing the built-in profiles took 90 ms of a resnet50's first ``optimize()`` in pure Python).

    PyYAML follows YAML 1.1, where ``1e4`` and ``1e-3`` (no dot) are *strings*: ``loss_scale: 1e4`` or
    ``lr: 1e-3`` would be rejected as "not a number". This loader resolves them as floats.
    """
    import re

    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"))
    return Loader


def read_yaml(path: Path) -> Dict[str, Any]:
    """The mapping a strategy file holds (a fresh copy: callers merge into it).

    Parsed once per file version (path, modification time, size): ``auto`` reads every profile and each one's
    ``extends`` chain on every ``optimize()``, and parsing them all again took ~0.1 s of a 0.4 s ``optimize()``
    of the demo (cProfile, 13 profiles, 27 reads).
    """
    import copy

    try:
        stat = os.stat(path)
    except OSError as e:
        raise StrategyError(f"{path}: cannot be read: {e}") from None
    return copy.deepcopy(_parse_yaml(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=256)
def _parse_yaml(path: str, mtime_ns: int, size: int) -> Dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_yaml_loader())
    except yaml.YAMLError as e:
        raise StrategyError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        warn_once(f"empty-strategy-{path}", f"aiak: the strategy file {path} is empty: it sets nothing, so it means "
                  "plain PyTorch (as strategy='default'); give it keys (precision: {level: O2}, say), or use "
                  "strategy='auto'")
        data = {}
    if not isinstance(data, dict):
        raise StrategyError(f"{path}: a strategy file must hold a mapping at the top level, got {type(data).__name__}")
    return data


def names_a_file(spec: str) -> bool:
    """A strategy string is a path (ends in .yaml/.yml or holds a path separator), else a profile name."""
    return spec.endswith((".yaml", ".yml")) or os.sep in spec


def locate(name_or_path: str, where: str, relative_to: Optional[Path] = None, *, top_level: bool = True) -> Path:
    """A profile name (the built-ins, then the user folders), or a YAML path (relative paths also tried beside
    the extending file).

    ``where`` says who asked (``strategy`` or ``<file>: extends``), so the error names it; ``top_level`` is
    False for an ``extends`` (where "auto", which is no file, cannot be named)."""
    if names_a_file(name_or_path):
        candidates = [Path(name_or_path)]
        if relative_to is not None and not Path(name_or_path).is_absolute():
            candidates.insert(0, relative_to.parent / name_or_path)
        for c in candidates:
            if c.is_file():
                return c
        raise StrategyError(f"{where}: strategy file {name_or_path!r} not found "
                            f"(looked at {', '.join(str(c) for c in candidates)})")
    by_name = next((f.path for f in profile_files() if f.name == name_or_path), None)
    if by_name is None and name_or_path == "auto" and top_level:
        raise StrategyError(f"{where}: 'auto' is no file of fixed knobs: aiak.optimize(strategy='auto') composes "
                            "them per model and machine from the profiles' match: rules; `aiak explain --model "
                            "SPEC` shows what it picks")
    if by_name is None:
        names = list_profiles()
        choices = ["auto"] + names if top_level else names
        raise StrategyError(f"{where}: unknown profile {name_or_path!r}{did_you_mean(name_or_path, choices)}; "
                            f"choices: {choices}, or a path to a .yaml file" + (" or a dict" if top_level else ""))
    return by_name


def replaces_parent_section(key: str, value: Any, old: Any) -> bool:
    """An ``optimizer`` section naming a different optimizer replaces the parent's section instead of merging
    into it (a parent's LAMB hyper-parameters mean nothing to LARS or to ``keep``)."""
    return key == "optimizer" and isinstance(value, Mapping) and isinstance(old, Mapping) \
        and "name" in value and value["name"] != old.get("name")


def merge(parent: Mapping[str, Any], child: Mapping[str, Any]) -> Dict[str, Any]:
    """Child over parent; mapping sections merge key by key (but see `replaces_parent_section`),
    everything else is replaced."""
    out = dict(parent)
    for key, value in child.items():
        old = out.get(key)
        if replaces_parent_section(key, value, old):
            out[key] = dict(value)
        elif isinstance(value, Mapping) and isinstance(old, Mapping):
            out[key] = merge(old, value)
        else:
            out[key] = value
    return out


def tune_as_mapping(value: Any) -> Any:
    """``tune:`` as written -> the mapping it means (``true`` -> ``{enabled: true}``, a mapping without
    ``enabled`` -> enabled); anything else is returned as it is, for the validation to report."""
    if isinstance(value, bool):
        return {"enabled": value}
    if isinstance(value, Mapping) and "enabled" not in value:
        return {"enabled": True, **value}
    return value


class Chain:
    """An ``extends`` chain merged into one mapping, remembering which file set each key; problems found
    on the way (an unknown parent, a cycle) are collected, not raised, so every mistake is reported at once."""

    def __init__(self):
        self.origins: Dict[str, str] = {}
        self.problems: List[str] = []
        self.files: List[Path] = []  # every file read, the extending one first

    def resolve(self, data: Mapping[str, Any], source: str, path: Optional[Path], seen: List[str]) -> Dict[str, Any]:
        if path is not None:
            self.files.append(path)
        if "tune" in data:  # `tune: true` means {enabled: true}: merged key by key over a parent's mapping
            data = {**data, "tune": tune_as_mapping(data["tune"])}
        parent: Dict[str, Any] = {}
        ref = data.get("extends")
        if ref is not None:
            parent = self._parent(ref, source, path, seen)
        merged = merge(parent, data)
        if replaces_parent_section("optimizer", data.get("optimizer"), parent.get("optimizer")):
            self._forget("optimizer")
        self.origins.update({k: source for k in key_paths(data)})
        return merged

    def _forget(self, key: str) -> None:
        """Drop the origins of ``key`` and of every key inside it."""
        self.origins = {k: v for k, v in self.origins.items() if k != key and not k.startswith(key + ".")}

    def _parent(self, ref: Any, source: str, path: Optional[Path], seen: List[str]) -> Dict[str, Any]:
        if not isinstance(ref, str):
            self.problems.append(f"{source}: extends must be a profile name or a YAML path, got {ref!r}")
            return {}
        try:
            parent_path = locate(ref, f"{source}: extends", relative_to=path, top_level=False)
            key = str(parent_path.resolve())
            if key in seen:
                raise StrategyError(f"{source}: extends: cycle through {ref!r}")
            data = read_yaml(parent_path)
        except StrategyError as e:
            self.problems.extend(e.problems)
            return {}
        parent = self.resolve(data, str(parent_path), parent_path, seen + [key])
        for own in ("name", "description", "match", "extends"):  # the profile's own, never inherited
            parent.pop(own, None)
            self._forget(own)
        return parent
