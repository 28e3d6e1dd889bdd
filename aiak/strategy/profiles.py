"""``load_strategy`` (name, YAML path or dict -> validated ``Strategy``) and the profiles as the auto-selector
overlays them (`Profile`: the strategy and which keys its file and ``extends`` chain set). Where profile
files are and how they are read and merged: `aiak.strategy.profile_files`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, FrozenSet, Mapping, Tuple, Union

from aiak.strategy.profile_files import ProfileFile, list_profiles, profile_files, profiles_dir, user_profile_dirs
from aiak.strategy.schema import Strategy, load_with_chain

__all__ = ["load_strategy", "Profile", "load_profile", "ProfileFile", "profile_files", "list_profiles", "profiles_dir",
           "user_profile_dirs"]


def load_strategy(spec: Union[str, os.PathLike, Mapping[str, Any], Strategy]) -> Strategy:
    """Load and validate a strategy from a profile's name, a YAML file or a dict.

    The one way every spelling of a strategy becomes a [aiak.Strategy][aiak.strategy.schema.Strategy], so each is
    validated alike: every mistake of the file and of the files it extends is reported at once, each with its file,
    key path and suggestion.

    Args:
        spec: a built-in or user profile name (`aiak profiles` lists them), a YAML path, a dict of the YAML's shape,
            or a `Strategy` (returned as it is).

    Returns:
        The validated strategy.

    Raises:
        StrategyError: an unknown profile or missing file, a file that is not YAML of a mapping, an `extends:`
            cycle, or any unknown key, wrong value or impossible combination (all of them in one error).
    """
    if isinstance(spec, Strategy):
        return spec
    return load_with_chain(spec)[0]


@dataclass(frozen=True)
class Profile:
    """A loaded profile as the auto-selector overlays it."""

    file: ProfileFile
    strategy: Strategy
    has_match: bool              # a profile without a ``match:`` key never takes part in auto
    sets: FrozenSet[str]         # dotted key paths it or its extends chain sets (default.yaml's excepted)
    files: Tuple[Path, ...]      # the file, then every file it extends

    @property
    def name(self) -> str:
        return self.file.name


def load_profile(file: ProfileFile) -> Profile:
    """Load and validate one profile file, remembering which keys it sets (see `Profile`)."""
    strategy, chain, data = load_with_chain(file.path)
    default = (profiles_dir() / "default.yaml").resolve()
    sets = frozenset(k for k, src in chain.origins.items() if Path(src).resolve() != default)
    return Profile(file, strategy, "match" in data, sets, tuple(chain.files))
