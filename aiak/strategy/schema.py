"""The strategy schema: one dataclass per YAML section, validated on construction.

The key names are a public contract: add keys, never rename them. Validation is
driven by the dataclass fields themselves (type annotation + ``metadata["choices"]``), so a new knob is
one new field. Every error names the source (file or "<dict>"), the dotted key path and the valid
choices, and is raised as a single :class:`StrategyError`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Union

PRECISION_LEVELS = ("O0", "O1", "O2")
PRECISION_DTYPES = ("fp16", "bf16")
OPTIMIZER_NAMES = ("keep", "lamb", "lars")
COMPRESSIONS = ("none", "fp16", "bf16", "int8")
FUSED_OPS = ("window_attention",)


class StrategyError(ValueError):
    """Bad strategy input. ``problems`` lists every mistake found, each naming its source (file or
    ``<dict>``), the dotted key path and what would be valid; the message shows them all."""

    def __init__(self, problems: Union[str, List[str]]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the strategy:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(message)


def _choices(*values: Any) -> Dict[str, Any]:
    return {"choices": tuple(values)}


_GRAMMAR = {"grammar": True}  # checked by aiak.strategy.rules.parse_condition instead of by its annotation


@dataclass
class Match:
    """When the auto-selector overlays this profile (unused by ``optimize`` with a named strategy): every
    condition given must hold. The grammar is :mod:`aiak.strategy.rules` (README: "How ``auto`` chooses");
    an empty list or None is no condition, so ``Match()`` (``match: {}``) matches everything."""

    modules: Union[List[str], Dict[str, List[str]]] = field(default_factory=list, metadata=_GRAMMAR)
    device: Optional[str] = field(default=None, metadata=_GRAMMAR)
    cuda_capability: Optional[str] = field(default=None, metadata=_GRAMMAR)
    cpu_features: Union[List[str], Dict[str, List[str]]] = field(default_factory=list, metadata=_GRAMMAR)
    world_size: Union[int, str, None] = field(default=None, metadata=_GRAMMAR)
    nodes: Union[int, str, None] = field(default=None, metadata=_GRAMMAR)
    params: Union[int, str, None] = field(default=None, metadata=_GRAMMAR)
    optimizer: List[str] = field(default_factory=list, metadata=_GRAMMAR)
    variable_length: Optional[bool] = field(default=None, metadata=_GRAMMAR)
    loader: Optional[bool] = field(default=None, metadata=_GRAMMAR)


@dataclass
class Precision:
    """Mixed precision: O0 fp32, O1 autocast, O2 half-precision compute copies of the fp32 parameters (apex O2's
    numerics; the parameters stay the user's fp32 tensors).

    ``loss_scale`` is ``dynamic``, a positive number (static scale) or ``none`` (no scaling; refused for
    fp16 at O1/O2, where small gradients underflow).
    """

    level: str = field(default="O0", metadata=_choices(*PRECISION_LEVELS))
    dtype: str = field(default="bf16", metadata=_choices(*PRECISION_DTYPES))
    loss_scale: Union[str, float] = field(default="dynamic", metadata=_choices("dynamic", "none", "<positive number>"))


@dataclass
class OptimizerConfig:
    """``keep`` the user's optimizer, or swap it for LAMB / LARS; other keys are hyper-parameters."""

    name: str = field(default="keep", metadata=_choices(*OPTIMIZER_NAMES))
    hyperparameters: Dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    def _problems(self, where: "_Where", path: str) -> List[str]:
        """Hyper-parameters, checked at load time by the optimizer factory's own rules (unknown key with
        "did you mean", wrong type, out of range), so a bad one fails before ``optimize()`` touches anything."""
        if self.name == "keep":
            return [f"{where(path + key)}: hyper-parameters need optimizer.name lamb or lars ('keep' leaves your "
                    f"optimizer as it is)" for key in self.hyperparameters]
        from aiak.optim.factory import hyperparameter_problems

        return [problem for key, value in self.hyperparameters.items()
                for problem in hyperparameter_problems(self.name, {key: value}, f"{where.source_of(path + key)}: {path}")]


@dataclass
class LoaderConfig:
    """Loader wrapping: ``prefetch`` batches kept ready by a background thread (0 = off), pinned host memory,
    length-balanced batches across ranks (optionally with a token budget per rank and step), and on-device
    normalization of uint8 images by the prefetcher (``mean``/``std`` in [0, 1] units, one value per channel).
    """

    prefetch: int = 0
    pin_memory: bool = False
    balanced: bool = False
    max_tokens: Optional[int] = None
    mean: Optional[List[float]] = None
    std: Optional[List[float]] = None


@dataclass
class CommConfig:
    """Communication under DDP (only used when a process group with world size > 1 exists).

    ``autotune`` times candidate algorithms (and, in ``comm`` perf mode, bucket sizes) during warm-up; rank 0
    decides, every rank follows, and the result is cached per model, cluster and torch version. int8 changes
    the numerics, so the tuner only considers it when ``tune_int8`` is true. ``deadlock_guard`` is a debug
    mode: ranks compare fingerprints of their collectives and raise instead of hanging (``timeout_s``).
    ``pipeline_mb`` cuts hierarchical buckets into chunks that overlap the intra- and inter-node steps (MB of
    fp32 values; int8 chunks hold twice as many values; 0 = whole buckets); ``compress_intra`` also compresses
    the intra-node steps (fp16/bf16); ``int8_block`` is the number of values sharing one min/scale.
    """

    hierarchical: Union[str, bool] = field(default="auto", metadata=_choices("auto", True, False))
    compression: str = field(default="none", metadata=_choices(*COMPRESSIONS))
    bucket_mb: float = 25.0
    autotune: bool = False
    perf_mode: str = field(default="comm", metadata=_choices("comm", "step"))
    tune_steps: int = 3
    tune_cache: Optional[str] = None
    tune_int8: bool = False
    deadlock_guard: bool = False
    timeout_s: float = 300.0
    compress_intra: bool = False
    int8_block: int = 2048
    pipeline_mb: float = 2.0


@dataclass
class TuneConfig:
    """Measured trials: time up to ``candidates`` strategies for ``steps`` steps each on the first batches and
    keep the fastest that passes the numerics gate (``aiak.tune``), within ``max_seconds`` if given.

    YAML takes ``tune: true | false`` or a mapping; a mapping means enabled unless it says ``enabled: false``.
    ``bool(tune)`` is ``enabled``.
    """

    enabled: bool = False
    candidates: int = 4
    steps: int = 3
    max_seconds: Optional[float] = None
    _SHAPE: ClassVar[str] = "true, false or a mapping {enabled, candidates, steps, max_seconds}"  # for errors

    def __bool__(self) -> bool:
        return self.enabled

    @staticmethod
    def normalise(value: Any) -> Any:
        """``tune:`` as written -> the mapping it means (``true`` -> ``{enabled: true}``, a mapping without
        ``enabled`` -> enabled); anything else is returned as it is, for the validation to report."""
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, Mapping) and "enabled" not in value:
            return {"enabled": True, **value}
        return value

    def _problems(self, where: "_Where", path: str) -> List[str]:
        problems = [f"{where(path + key)} must be >= 1, got {getattr(self, key)}"
                    for key in ("candidates", "steps") if getattr(self, key) < 1]
        if self.max_seconds is not None and not self.max_seconds > 0:
            problems.append(f"{where(path + 'max_seconds')} must be > 0 seconds or null (no limit), "
                            f"got {self.max_seconds}")
        return problems


@dataclass
class Strategy:
    """A validated strategy: what ``aiak.optimize`` applies, knob by knob."""

    name: str = "custom"
    extends: Optional[str] = None
    description: str = ""
    match: Match = field(default_factory=Match)
    tf32: bool = False
    cudnn_benchmark: bool = False
    channels_last: bool = False
    compile: bool = False
    precision: Precision = field(default_factory=Precision)
    grad_accumulation: int = 1
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    fused_ops: List[str] = field(default_factory=list, metadata=_choices(*FUSED_OPS))
    comm: CommConfig = field(default_factory=CommConfig)
    cpu_affinity: bool = False
    tune: TuneConfig = field(default_factory=TuneConfig)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>",
                  origins: Optional[Mapping[str, str]] = None, combinations: bool = True) -> "Strategy":
        """Build and validate from a plain dict (already merged with any ``extends`` parent).

        Every mistake is collected and raised together as one :class:`StrategyError`. ``origins`` maps a dotted
        key path to the file that set it (``extends`` chains), so each problem names the right file.
        ``combinations=False`` checks keys and values only (the caller knows part of the strategy is missing).
        """
        problems: List[str] = []
        strategy = _build(cls, data, _Where(source, origins or {}), "", problems)
        if not problems and combinations:
            _check_combinations(strategy, source, problems)
        if problems:
            raise StrategyError(problems)
        return strategy

    @classmethod
    def from_yaml(cls, path: str) -> "Strategy":
        """Load a YAML file (following ``extends:``) and validate it."""
        from aiak.strategy.profiles import load_strategy

        return load_strategy(path)

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict in the YAML shape (``optimizer`` hyper-parameters flattened beside ``name``)."""
        out = dataclasses.asdict(self)
        opt = out["optimizer"]
        out["optimizer"] = {"name": opt["name"], **opt["hyperparameters"]}
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- validation ---------------------------------------------------------------------------------
class _Invalid(Exception):
    """One bad value; the text follows the key path in the reported problem."""


@dataclass(frozen=True)
class _Where:
    """Where a key came from: the file that set it (``origins``), else the strategy's own source."""

    source: str
    origins: Mapping[str, str]

    def source_of(self, path: str) -> str:
        key = path.rstrip(".")
        while key and key not in self.origins:
            key = key.rpartition(".")[0]
        return self.origins.get(key, self.source)

    def __call__(self, path: str) -> str:
        return f"{self.source_of(path)}: {path.rstrip('.') or '<top level>'}"


def _type_name(annotation: Any) -> str:
    names = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string",
             "List[str]": "a list of strings", "List[float]": "a list of numbers", "Dict[str, Any]": "a mapping"}
    return names.get(str(annotation), str(annotation))


def _check_value(value: Any, annotation: str, choices: tuple) -> Any:
    """Check one scalar/list value against its annotation and choices; return it normalised or raise _Invalid."""
    if annotation == "Union[str, float]":  # precision.loss_scale
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) \
                or (isinstance(value, str) and value not in ("dynamic", "none")) \
                or (not isinstance(value, str) and not value > 0):
            raise _Invalid(f" must be one of {list(choices)}, got {value!r}")
        return value if isinstance(value, str) else float(value)
    if annotation == "Union[str, bool]":  # comm.hierarchical
        if value not in choices or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise _Invalid(f" must be one of ['auto', true, false], got {value!r}")
        return value
    if value is None and annotation.startswith("Optional["):
        return None
    annotation = annotation[len("Optional["):-1] if annotation.startswith("Optional[") else annotation
    expected = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "List[str]": (list,),
                "List[float]": (list,), "Dict[str, Any]": (dict,)}[annotation]
    if isinstance(value, bool) and bool not in expected:
        raise _Invalid(f" must be {_type_name(annotation)}, got {value!r}")
    if not isinstance(value, expected):
        raise _Invalid(f" must be {_type_name(annotation)}, got {type(value).__name__} {value!r}")
    if annotation == "List[float]":
        if not value or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
            raise _Invalid(f" must be a non-empty list of numbers, got {value!r}")
        return [float(v) for v in value]
    if annotation == "List[str]":
        for item in value:
            if not isinstance(item, str):
                raise _Invalid(f" must be a list of strings, got item {item!r}")
            if choices and item not in choices:
                raise _Invalid(f": unknown entry {item!r}{did_you_mean(item, choices)}; valid choices: {list(choices)}")
        return list(value)
    if choices and value not in choices:
        raise _Invalid(f" must be one of {list(choices)}, got {value!r}{did_you_mean(value, choices)}")
    if annotation == "float":
        return float(value)
    return value


def did_you_mean(given: Any, choices) -> str:
    """`` (did you mean 'x'?)`` for a near miss (case-insensitive), else ``""``."""
    if not isinstance(given, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    by_lower = {c.lower(): c for c in names}
    close = difflib.get_close_matches(given.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close and by_lower[close[0]] != given else ""


def _build(cls: type, data: Any, where: _Where, path: str, problems: List[str]) -> Any:
    """An instance of the dataclass ``cls`` from ``data``; every bad key is appended to ``problems`` (and
    left at its default) so that all mistakes are reported together."""
    if not isinstance(data, Mapping):
        shape = getattr(cls, "_SHAPE", "a mapping")
        problems.append(f"{where(path)} must be {shape}, got {type(data).__name__} {data!r}")
        return cls()
    before = len(problems)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rest = next((f for f in fields.values() if f.metadata.get("rest")), None)
    known = [n for n, f in fields.items() if not f.metadata.get("rest")]
    kwargs: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"{where(path)}: key {key!r}: keys must be strings")
            continue
        if key not in known:
            if rest is not None:
                extra[key] = value
                continue
            problems.append(f"{where(path + key)}: unknown key{did_you_mean(key, known)}; valid keys: {known}")
            continue
        f = fields[key]
        if dataclasses.is_dataclass(f.default_factory() if f.default_factory is not dataclasses.MISSING else None):
            section = type(f.default_factory())
            kwargs[key] = _build(section, getattr(section, "normalise", lambda v: v)(value), where,
                                 f"{path}{key}.", problems)
            continue
        try:
            if f.metadata.get("grammar"):
                kwargs[key] = _parse_condition(key, value)
            else:
                kwargs[key] = _check_value(value, str(f.type), f.metadata.get("choices", ()))
        except _Invalid as e:
            problems.append(f"{where(path + key)}{e}")
    if rest is not None:
        kwargs[rest.name] = extra
    built = cls(**kwargs)
    check_section = getattr(built, "_problems", None)
    if check_section is not None and len(problems) == before:  # needs the section's own keys to be valid
        problems.extend(check_section(where, path))
    return built


def _parse_condition(key: str, value: Any) -> Any:
    """A ``match:`` condition checked by the grammar (:mod:`aiak.strategy.rules`, imported here because it
    builds on this module)."""
    from aiak.strategy.rules import MatchSyntaxError, parse_condition

    try:
        return parse_condition(key, value)
    except MatchSyntaxError as e:
        raise _Invalid(str(e)) from None


def check_comm(comm: CommConfig, source: str) -> None:
    """Types, choices and ranges of a ``CommConfig``, also one built in code rather than from YAML."""
    problems: List[str] = []
    for f in dataclasses.fields(comm):
        try:
            _check_value(getattr(comm, f.name), str(f.type), f.metadata.get("choices", ()))
        except _Invalid as e:
            problems.append(f"{source}: comm.{f.name}{e}")
    if not problems:
        _check_comm_ranges(comm, source, problems)
    if problems:
        raise StrategyError(problems)


def _check_comm_ranges(comm: CommConfig, source: str, problems: List[str]) -> None:
    for key, low, strict in (("bucket_mb", 0, True), ("timeout_s", 0, True), ("tune_steps", 1, False),
                             ("int8_block", 1, False), ("pipeline_mb", 0, False)):
        value = getattr(comm, key)
        if value < low or (strict and value == low):
            problems.append(f"{source}: comm.{key} must be {'>' if strict else '>='} {low}, got {value}")


def _check_combinations(s: Strategy, source: str, problems: List[str]) -> None:
    """Ranges and impossible combinations, each with the key path that must change."""
    p = s.precision
    if p.level in ("O1", "O2") and p.dtype == "fp16" and p.loss_scale == "none":
        problems.append(
            f"{source}: precision.loss_scale: fp16 at {p.level} needs loss scaling (small gradients underflow "
            f"in fp16); set loss_scale to 'dynamic' or a positive number, or use dtype: bf16")
    if s.grad_accumulation < 1:
        problems.append(f"{source}: grad_accumulation must be an integer >= 1, got {s.grad_accumulation}")
    if s.loader.prefetch < 0:
        problems.append(f"{source}: loader.prefetch must be >= 0 (0 turns prefetching off), got {s.loader.prefetch}")
    _check_comm_ranges(s.comm, source, problems)
    loader = s.loader
    if (loader.mean is None) != (loader.std is None) or (loader.mean and len(loader.mean) != len(loader.std)):
        problems.append(f"{source}: loader.mean and loader.std go together, one value per channel each")
    if loader.mean is not None and loader.prefetch == 0:
        problems.append(f"{source}: loader.mean/std need loader.prefetch >= 1 (the prefetcher normalizes)")
    if loader.max_tokens is not None and (loader.max_tokens < 1 or not loader.balanced):
        problems.append(f"{source}: loader.max_tokens needs loader.balanced: true and a value >= 1")
    if s.loader.pin_memory and s.loader.prefetch == 0:
        problems.append(f"{source}: loader.pin_memory needs loader.prefetch >= 1 (pinning happens in the prefetcher)")
