"""Strategy resolution for ``optimize()``: a named strategy is loaded; ``"auto"`` is composed from the profiles'
``match:`` rules, with the profile that set each knob and why.

How ``"auto"`` composes (README, "How ``auto`` chooses"):

1. probe the hardware, process group, model, loader and optimizer (`aiak.strategy.probes.probe`);
2. start from ``default.yaml`` (plain PyTorch);
3. evaluate the profiles in order (`aiak.strategy.profiles.profile_files`): the built-in ones sorted by
   name, then each folder of ``AIAK_PROFILE_PATH``, then ``~/.config/aiak/profiles/``, each sorted by name.
   A profile without a ``match:`` key is skipped (it is used only by name). Each one whose ``match:`` holds is
   overlaid on the strategy built so far; it contributes only the keys it or its ``extends`` chain sets
   (``default.yaml``'s values are not re-applied), later profiles win knob by knob, and an ``optimizer``
   section naming another optimizer replaces the whole section.

No hardware or model policy is written here: the rules are the YAML files. One guard is kept, because it is
a fact and not a policy: a composition that would run fp16 where the probes found no fp16 hardware keeps the
precision it had before that profile, and says why.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from torch import nn

from aiak.amp.emulation import FP16_CPU_COST
from aiak.amp.fp8 import torchao_problem
from aiak.comm.sharded import ENGINE_NAMES
from aiak.strategy.probes import Probes, model_features, probe
from aiak.strategy.profile_files import merge, names_a_file, profile_files, replaces_parent_section
from aiak.strategy.profiles import Profile, load_profile, load_strategy
from aiak.strategy.rules import match_profile
from aiak.strategy.schema import Strategy, StrategyError, load_with_chain
from aiak.strategy import key_paths
from aiak.strategy.key_paths import get_leaf, put_leaf
from aiak.strategy.sharded import refusals, sharded_by, what_auto_leaves_out
from aiak.util.warn import warn_once

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

__all__ = ["Knob", "Selection", "select", "compose", "select_strategy", "resolve_strategy", "model_features",
           "leaves"]

Reasons = Dict[str, str]
NOT_KNOBS = ("name", "extends", "description", "match")
DEFAULT_REASON = "no profile that matched sets it: default.yaml's value (plain PyTorch)"


@dataclass
class Knob:
    """One leaf of the strategy: its value, who set it and why."""

    value: Any
    source: str      # "default" | "profile:<name>" | "user"   (the record adds "measured" and "derived")
    reason: str


@dataclass
class Selection:
    """What the selector decided, knob by knob, and on what evidence."""

    strategy: Strategy            # the pick; for auto its name is "auto"
    knobs: Dict[str, Knob]        # every leaf key path of strategy.to_dict() but name/extends/description/match
    matched: List[str]            # names of the profiles that matched, in evaluation order
    skipped: Dict[str, str]       # profile name -> why it did not match
    probes: Probes
    profiles_digest: str          # sha1 over every profile file evaluated (part of the tuning cache key)

    @property
    def reasons(self) -> Dict[str, str]:
        """``{key path: reason}`` for every knob, plus ``"*"``: one line saying how the strategy was chosen."""
        if self.matched or self.skipped:
            summary = (f"auto: default.yaml, then each profile whose match: holds, in order: "
                       f"{', '.join(self.matched) or 'none'} ({len(self.skipped)} skipped: {', '.join(self.skipped)})")
        else:
            summary = f"strategy {self.strategy.name!r} given explicitly" + (
                f": {self.strategy.description}" if self.strategy.description else "")
        return {"*": summary, **{path: knob.reason for path, knob in self.knobs.items()}}


# -- entry points -------------------------------------------------------------------------------------------
def select(model: Optional[nn.Module], optimizer=None, loader=None, *, device: Any = None) -> Selection:
    """The auto-selector (rules only, no trials): probe, then `compose`."""
    return compose(probe(model, optimizer, loader, device))


def select_strategy(model: Optional[nn.Module], optimizer: Optional[Optimizer] = None,
                    loader: Optional[Iterable] = None, *,
                    device: Union[str, torch.device, None] = None) -> Tuple[Strategy, Reasons]:
    """The strategy the auto-selector's rules pick for these objects on this machine, without trials.

    What `strategy="auto"` starts from before it measures anything: the profiles whose `match:` rules fit the
    model, the loader and the machine, overlaid in order. Nothing is measured and the objects are not changed.

    Args:
        model: the model (None: the rules judge the machine alone).
        optimizer: its optimizer, or None.
        loader: its loader, or None (the rules read its batches' shapes).
        device: where the model will train (default: where its parameters are).

    Returns:
        `(strategy, reasons)`: the composed strategy, and for each knob the rule (profile) that set it.

    Raises:
        StrategyError: a profile (built-in or the user's) is broken; every problem of every profile at once.
    """
    selection = select(model, optimizer, loader, device=device)
    return selection.strategy, selection.reasons


def resolve_strategy(spec: Any, model=None, optimizer=None, loader=None, *, device: Any = None) -> Selection:
    """``optimize()``'s first step: ``"auto"`` -> `select`; anything else -> ``load_strategy``, each knob
    that differs from ``default.yaml`` attributed to the profile (``profile:<name>``, for a profile name) or to
    the user (a path, dict or ``Strategy``)."""
    if isinstance(spec, str) and spec == "auto":
        return select(model, optimizer, loader, device=device)
    if isinstance(spec, (str, os.PathLike)):
        strategy, chain, _ = load_with_chain(spec)
        files, extra = chain.files, b""
    else:
        strategy, files = load_strategy(spec), []
        extra = json.dumps(strategy.to_dict(), sort_keys=True, default=str).encode()
    named = isinstance(spec, str) and not names_a_file(spec)
    source = f"profile:{spec}" if named else "user"
    what = f"profile {spec!r}" if named else f"the strategy given ({_describe_spec(spec)})"
    default = dict(leaves(load_strategy("default").to_dict()))
    knobs = {}
    for path, value in leaves(strategy.to_dict()):
        if path in default and value == default[path]:
            knobs[path] = Knob(value, "default", f"{what} leaves it at default.yaml's value")
        else:
            was = f"default: {_show(default[path])}" if path in default else "not in default.yaml"
            knobs[path] = Knob(value, source, f"set by {what} ({was})")
    return Selection(strategy, knobs, [], {}, probe(model, optimizer, loader, device), _digest(files, extra))


# -- composition --------------------------------------------------------------------------------------------
def compose(probes: Probes) -> Selection:
    """The strategy the profiles' rules compose for ``probes`` (a machine, model and loader, real or described).

    Every profile is loaded and validated first; all their problems are raised together as one
    `StrategyError`, so a broken user profile is reported, never silently left out.
    """
    profiles, problems = [], []
    for file in profile_files():
        try:
            profiles.append(load_profile(file))
        except StrategyError as e:
            problems.extend(e.problems)
    if problems:
        raise StrategyError(problems)
    data = load_strategy("default").to_dict()
    knobs: Dict[str, Knob] = {}  # only the knobs a profile set; the rest are default's
    matched: List[str] = []
    skipped: Dict[str, str] = {}
    for profile in profiles:
        if not profile.has_match:
            skipped[profile.name] = "no match: section (used only when named)"
            continue
        ok, why = match_profile(profile.strategy.match, probes)
        if not ok:
            skipped[profile.name] = why
            continue
        matched.append(profile.name)
        data = _overlay(data, knobs, profile, why, probes)
    sharding = sharded_by(data, probes.sharding, probes.world_size)
    if sharding:
        _leave_out_what_sharding_refuses(data, knobs, sharding)
    data.update(name="auto", extends=None, description=f"composed by the auto-selector from {', '.join(matched)}")
    strategy = _validated(data, knobs, matched)
    all_knobs = {path: knobs.get(path) or Knob(value, "default", DEFAULT_REASON)
                 for path, value in leaves(strategy.to_dict())}
    files = [path for profile in profiles for path in profile.files]
    return Selection(strategy, all_knobs, matched, skipped, probes, _digest(files))


def _overlay(data: Dict[str, Any], knobs: Dict[str, Knob], profile: Profile, why: str, probes: Probes
             ) -> Dict[str, Any]:
    """``data`` with the keys ``profile`` sets put over it; ``knobs`` updated in place."""
    contribution: Dict[str, Any] = {}
    for path, value in leaves(profile.strategy.to_dict()):
        if path in profile.sets:
            put_leaf(contribution, path, value)
    if replaces_parent_section("optimizer", contribution.get("optimizer"), data.get("optimizer")):
        for path in [p for p in knobs if p.startswith("optimizer.")]:
            del knobs[path]
    precision_before = dict(data["precision"])
    knobs_before = {p: k for p, k in knobs.items() if p.startswith("precision.")}
    merged = merge(data, contribution)
    source = f"profile:{profile.name}"
    reason = f"profile {profile.name!r} matched ({why}): {profile.strategy.description}"
    for path, value in leaves(contribution):
        knobs[path] = Knob(value, source, reason)
    refused = _precision_refused(merged["precision"], probes)
    if refused:
        asked, why = refused
        merged["precision"] = precision_before
        for path, value in leaves({"precision": precision_before}):
            kept = knobs_before.get(path) or Knob(value, "default", DEFAULT_REASON)
            knobs[path] = Knob(value, kept.source, f"{kept.reason}; kept although profile {profile.name!r} asks for "
                                                   f"{asked}: {why}")
        warn_once(f"auto-precision-refused:{profile.file.path}",
                  f"aiak: strategy 'auto' ignored the {asked} precision of profile {profile.name!r} "
                  f"({profile.file.path}): {why}")
    return merged


def _leave_out_what_sharding_refuses(data: Dict[str, Any], knobs: Dict[str, Knob], sharding: str) -> None:
    """A model the script sharded: each knob the composition set that cannot apply to it (`aiak.strategy.sharded`)
    back at ``default.yaml``'s value, with why, and one warning saying so (trials included: they are off)."""
    default = load_strategy("default").to_dict()
    refused = refusals(data, sharding)
    for path, why in refused:
        put_leaf(data, path, get_leaf(default, path))
        for leaf in [p for p in knobs if p == path or p.startswith(path + ".")]:
            del knobs[leaf]
        for leaf, value in leaves({"x": get_leaf(default, path)}):
            leaf_path = path + leaf[1:]
            knobs[leaf_path] = Knob(value, "default", f"{what_auto_leaves_out(sharding)}: {why}")
    if refused:
        left = [path for path, _ in refused if path != "tune"]
        said = ([f"{', '.join(left)} left at default.yaml's values"] if left else []) + \
            (["no trials (they time copies of the model)"] if len(left) < len(refused) else [])
        warn_once(f"auto-sharded:{sharding}", f"aiak: strategy 'auto' on a model sharded by {ENGINE_NAMES[sharding]}: "
                                              f"{'; '.join(said)}. aiak.last_decision() says why for each knob")


def _fp16_refused(precision: Dict[str, Any], probes: Probes) -> Optional[str]:
    """Why fp16 cannot be composed here, or None when the precision is not fp16 or the device has fp16."""
    if precision["level"] == "O0" or precision["dtype"] != "fp16" or probes.fp16_native:
        return None
    if probes.device == "cuda":
        capability = probes.cuda_capability
        found = f"compute capability {capability[0]}.{capability[1]}" if capability else "no CUDA device found"
        return f"this GPU has no fp16 tensor cores ({found}, they need 7.0 or newer)"
    return f"this {probes.device} has no fp16 hardware, so fp16 would be emulated: {FP16_CPU_COST}"


def _precision_refused(precision: Dict[str, Any], probes: Probes) -> Optional[Tuple[str, str]]:
    """``(what was asked, why it cannot run here)`` for a composed precision the machine cannot run (fp16 without
    fp16 hardware, fp8 without torchao), or None."""
    fp16 = _fp16_refused(precision, probes)
    if fp16:
        return "fp16", fp16
    if precision.get("fp8", "off") != "off":
        problem = torchao_problem()
        if problem:
            return f"fp8 {precision['fp8']}", f"precision.fp8 {problem}"
    return None


def _validated(data: Dict[str, Any], knobs: Dict[str, Knob], matched: List[str]) -> Strategy:
    """The composed strategy, validated; an impossible combination names the profiles that set its knobs."""
    try:
        return Strategy.from_dict(data, source="auto")
    except StrategyError as e:
        setters = ", ".join(f"{path} = {_show(k.value)} from {k.source}" for path, k in knobs.items())
        raise StrategyError(e.problems + [f"auto: the profiles that matched ({', '.join(matched)}) set {setters}; "
                                          f"change the profile that conflicts"]) from None


# -- helpers ------------------------------------------------------------------------------------------------
def leaves(data: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """``(dotted path, value)`` of every leaf knob of a strategy dict (its name, description, ... are no knobs)."""
    return ((path, value) for path, value in key_paths.leaves(data) if path.partition(".")[0] not in NOT_KNOBS)


def _digest(files: Iterable[Path], extra: bytes = b"") -> str:
    """sha1 over the name and bytes of each file (once each, in order), then ``extra``."""
    sha, seen = hashlib.sha1(), set()
    for path in files:
        key = Path(path).resolve()
        if key in seen:
            continue
        seen.add(key)
        sha.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    sha.update(extra)
    return sha.hexdigest()


def _describe_spec(spec: Any) -> str:
    if isinstance(spec, Strategy):
        return "an aiak.Strategy"
    if isinstance(spec, (str, os.PathLike)):
        return os.fspath(spec)
    return "a dict"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)
