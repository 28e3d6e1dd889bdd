"""The strategy schema: one dataclass per YAML section, validated on construction.

The key names are a public contract (../shared/DESIGN.md): add keys, never rename them. Validation is
driven by the dataclass fields themselves (type annotation + ``metadata["choices"]``), so a new knob is
one new field. Every error names the source (file or "<dict>"), the dotted key path and the valid
choices, and is raised as a single :class:`StrategyError`.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Union

PRECISION_LEVELS = ("O0", "O1", "O2")
PRECISION_DTYPES = ("fp16", "bf16")
OPTIMIZER_NAMES = ("keep", "lamb", "lars")
COMPRESSIONS = ("none", "fp16", "bf16", "int8")
FUSED_OPS = ("window_attention",)


class StrategyError(ValueError):
    """Bad strategy input: names the source, the key path and what would be valid."""


def _choices(*values: Any) -> Dict[str, Any]:
    return {"choices": tuple(values)}


@dataclass
class Match:
    """Conditions the auto-selector checks before proposing this profile (unused by ``optimize``)."""

    modules: List[str] = field(default_factory=list)
    cuda_capability: Optional[str] = None


@dataclass
class Precision:
    """Mixed precision: O0 fp32, O1 autocast, O2 half model + fp32 master weights (apex semantics).

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
    tune: bool = False

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> "Strategy":
        """Build and validate from a plain dict (already merged with any ``extends`` parent)."""
        strategy = _build(cls, data, source, path="")
        _check_combinations(strategy, source)
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
def _type_name(annotation: Any) -> str:
    names = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string",
             "List[str]": "a list of strings", "List[float]": "a list of numbers", "Dict[str, Any]": "a mapping"}
    return names.get(str(annotation), str(annotation))


def _check_value(value: Any, annotation: str, choices: tuple, where: str) -> Any:
    """Check one scalar/list value against its annotation and choices; return it normalised."""
    if annotation == "Union[str, float]":  # precision.loss_scale
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise StrategyError(f"{where} must be one of {list(choices)}, got {value!r}")
        if isinstance(value, str) and value not in ("dynamic", "none"):
            raise StrategyError(f"{where} must be one of {list(choices)}, got {value!r}")
        if not isinstance(value, str):
            if value <= 0:
                raise StrategyError(f"{where} must be one of {list(choices)}, got {value!r}")
            return float(value)
        return value
    if annotation == "Union[str, bool]":  # comm.hierarchical
        if value not in choices or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise StrategyError(f"{where} must be one of ['auto', true, false], got {value!r}")
        return value
    if value is None and annotation.startswith("Optional["):
        return None
    annotation = annotation[len("Optional["):-1] if annotation.startswith("Optional[") else annotation
    expected = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "List[str]": (list,),
                "List[float]": (list,), "Dict[str, Any]": (dict,)}[annotation]
    if isinstance(value, bool) and bool not in expected:
        raise StrategyError(f"{where} must be {_type_name(annotation)}, got {value!r}")
    if not isinstance(value, expected):
        raise StrategyError(f"{where} must be {_type_name(annotation)}, got {type(value).__name__} {value!r}")
    if annotation == "List[float]":
        if not value or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
            raise StrategyError(f"{where} must be a non-empty list of numbers, got {value!r}")
        return [float(v) for v in value]
    if annotation == "List[str]":
        for item in value:
            if not isinstance(item, str):
                raise StrategyError(f"{where} must be a list of strings, got item {item!r}")
            if choices and item not in choices:
                raise StrategyError(f"{where}: unknown entry {item!r}; valid choices: {list(choices)}")
        return list(value)
    if choices and value not in choices:
        raise StrategyError(f"{where} must be one of {list(choices)}, got {value!r}")
    if annotation == "float":
        return float(value)
    return value


def _build(cls: type, data: Any, source: str, path: str) -> Any:
    where_section = f"{source}: {path.rstrip('.') or '<top level>'}"
    if not isinstance(data, Mapping):
        raise StrategyError(f"{where_section} must be a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rest = next((f for f in fields.values() if f.metadata.get("rest")), None)
    known = [n for n, f in fields.items() if not f.metadata.get("rest")]
    kwargs: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    for key, value in data.items():
        where = f"{source}: {path}{key}"
        if not isinstance(key, str):
            raise StrategyError(f"{where}: keys must be strings")
        if key not in known:
            if rest is not None:
                extra[key] = value
                continue
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise StrategyError(f"{where}: unknown key{hint}; valid keys: {known}")
        f = fields[key]
        if dataclasses.is_dataclass(f.default_factory() if f.default_factory is not dataclasses.MISSING else None):
            kwargs[key] = _build(type(f.default_factory()), value, source, f"{path}{key}.")
        else:
            kwargs[key] = _check_value(value, str(f.type), f.metadata.get("choices", ()), where)
    if rest is not None:
        kwargs[rest.name] = extra
    return cls(**kwargs)


def check_comm(comm: CommConfig, source: str) -> None:
    """Types, choices and ranges of a ``CommConfig``, also one built in code rather than from YAML."""
    for f in dataclasses.fields(comm):
        _check_value(getattr(comm, f.name), str(f.type), f.metadata.get("choices", ()), f"{source}: comm.{f.name}")
    for key, low, strict in (("bucket_mb", 0, True), ("timeout_s", 0, True), ("tune_steps", 1, False),
                             ("int8_block", 1, False), ("pipeline_mb", 0, False)):
        value = getattr(comm, key)
        if value < low or (strict and value == low):
            raise StrategyError(f"{source}: comm.{key} must be {'>' if strict else '>='} {low}, got {value}")


def _check_combinations(s: Strategy, source: str) -> None:
    """Impossible combinations, each with the key path that must change."""
    p = s.precision
    if p.level in ("O1", "O2") and p.dtype == "fp16" and p.loss_scale == "none":
        raise StrategyError(
            f"{source}: precision.loss_scale: fp16 at {p.level} needs loss scaling (small gradients underflow "
            f"in fp16); set loss_scale to 'dynamic' or a positive number, or use dtype: bf16")
    if s.grad_accumulation < 1:
        raise StrategyError(f"{source}: grad_accumulation must be an integer >= 1, got {s.grad_accumulation}")
    if s.loader.prefetch < 0:
        raise StrategyError(f"{source}: loader.prefetch must be >= 0 (0 turns prefetching off), got {s.loader.prefetch}")
    check_comm(s.comm, source)
    loader = s.loader
    if (loader.mean is None) != (loader.std is None) or (loader.mean and len(loader.mean) != len(loader.std)):
        raise StrategyError(f"{source}: loader.mean and loader.std go together, one value per channel each")
    if loader.mean is not None and loader.prefetch == 0:
        raise StrategyError(f"{source}: loader.mean/std need loader.prefetch >= 1 (the prefetcher normalizes)")
    if loader.max_tokens is not None and (loader.max_tokens < 1 or not loader.balanced):
        raise StrategyError(f"{source}: loader.max_tokens needs loader.balanced: true and a value >= 1")
    if s.loader.pin_memory and s.loader.prefetch == 0:
        raise StrategyError(f"{source}: loader.pin_memory needs loader.prefetch >= 1 (pinning happens in the prefetcher)")
