"""The strategy schema: the ``Strategy`` composed of the sections its subsystems own, validated on construction.

The key names are a public contract: add keys, never rename them. Each section is a dataclass kept beside the
code that reads it (``precision:`` in `aiak.amp.config`, ``optimizer:`` in `aiak.optim.config`,
``loader:`` in `aiak.loaders.config`, ``comm:`` in `aiak.comm.config`, ``match:`` in
`aiak.strategy.rules`); validation is driven by the fields' types and metadata (`aiak.util.config`), so
a new knob is one new field. Every error names the source (file or "<dict>"), the dotted key path and the
valid choices, and all of them are raised together as a single `StrategyError`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Union

from aiak.amp.config import Precision
from aiak.comm.config import CommConfig
from aiak.loaders.config import LoaderConfig
from aiak.ops.surgery import FUSED_OPS
from aiak.optim.config import OptimizerConfig
from aiak.strategy.profile_files import Chain, locate, read_yaml, tune_as_mapping
from aiak.strategy.rules import Match
from aiak.util.config import StrategyError, Where, build, choices

__all__ = ["Strategy", "StrategyError", "TuneConfig", "Match", "Precision", "OptimizerConfig", "LoaderConfig",
           "CommConfig", "load_with_chain"]


@dataclass
class TuneConfig:
    """Measured trials: time up to ``candidates`` strategies for ``steps`` steps each on the first batches and
    keep the fastest that passes the numerics gate (``aiak.tune``), within ``max_seconds`` if given; with
    ``guard`` (the default), the run's first real steps check the pick against plain compute in alternating windows
    and fall back to plain where it is slower (`aiak.tune.guard`; those steps compute both ways, so a run equals
    the winner's applied alone bit for bit only with ``guard: false``).

    YAML takes ``tune: true | false`` or a mapping; a mapping means enabled unless it says ``enabled: false``.
    ``bool(tune)`` is ``enabled``.
    """

    enabled: bool = False
    candidates: int = 4
    steps: int = 3
    max_seconds: Optional[float] = None
    guard: bool = True
    _SHAPE: ClassVar[str] = "true, false or a mapping {enabled, candidates, steps, max_seconds, guard}"  # errors

    def __bool__(self) -> bool:
        return self.enabled

    normalise = staticmethod(tune_as_mapping)

    def _problems(self, where: Where, path: str) -> List[str]:
        problems = [f"{where(path + key)} must be >= 1, got {getattr(self, key)}"
                    for key in ("candidates", "steps") if getattr(self, key) < 1]
        if self.max_seconds is not None and not self.max_seconds > 0:
            problems.append(f"{where(path + 'max_seconds')} must be > 0 seconds or null (no limit), "
                            f"got {self.max_seconds}")
        return problems


@dataclass
class Strategy:
    """A strategy: what [aiak.optimize][aiak.api.optimize] applies, knob by knob, one section per subsystem.

    One object with every knob, so that a profile, a dict and the auto-selector's pick are compared, cached, logged
    and applied alike. Build it with [from_dict][aiak.strategy.schema.Strategy.from_dict],
    [from_yaml][aiak.strategy.schema.Strategy.from_yaml] or [aiak.load_strategy][aiak.strategy.profiles.load_strategy],
    which validate every key; the constructor itself checks nothing. The keys, their choices and the built-in
    profiles are described on the strategy page of these docs.

    Args:
        name: the profile's name (a YAML file's stem by default).
        extends: the profile this one inherits and overrides (`default` for a fresh one).
        description: one line saying what the profile is for.
        match: when the auto-selector applies the profile (module kinds, device, CUDA capability, CPU features).
        tf32: TF32 matmuls and convolutions (CUDA compute capability 8.0+).
        cudnn_benchmark: cuDNN autotuning per input shape.
        channels_last: NHWC memory format for the model and the loader's 4-D images.
        compile: `torch.compile` the model, last.
        precision: mixed precision: `level` O0/O1/O2, `dtype` fp16/bf16, `loss_scale`, `keep_fp32`, `fp8`.
        grad_accumulation: micro-batches per optimizer step (1: none).
        optimizer: `keep` the script's optimizer, or swap it for LAMB/LARS with their hyper-parameters.
        loader: prefetching depth, pinned memory, length-balanced batches.
        fused_ops: module surgery: `window_attention`, `linear_cross_entropy`.
        comm: distributed training: the engine (DDP or FSDP2), the allreduce's route, compression and buckets,
            the communication algorithm.
        cpu_affinity: pin each rank's threads to its cores.
        malloc_retain: glibc malloc keeps the memory a step frees for the next (no page faults each step).
        tune: time candidate strategies on the first batches and keep the fastest that trains the same model.
    """

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
    fused_ops: List[str] = field(default_factory=list, metadata=choices(*FUSED_OPS))
    comm: CommConfig = field(default_factory=CommConfig)
    cpu_affinity: bool = False
    malloc_retain: bool = False
    tune: TuneConfig = field(default_factory=TuneConfig)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>",
                  origins: Optional[Mapping[str, str]] = None, combinations: bool = True) -> "Strategy":
        """Build and validate a strategy from a plain dict of the YAML's shape.

        Every mistake is collected and raised together, so one run shows them all.

        Args:
            data: the strategy's keys, already merged with any `extends` parent.
            source: where `data` came from, named in each problem (a file, or `<dict>`).
            origins: a dotted key path to the file that set it (`extends` chains), so each problem names the
                right file.
            combinations: False checks keys and values only (the caller knows part of the strategy is missing).

        Returns:
            The validated strategy.

        Raises:
            StrategyError: every unknown key, wrong type or value and impossible combination, at once.
        """
        problems: List[str] = []
        where = Where(source, origins or {})
        strategy = build(cls, data, where, "", problems)
        if not problems and combinations:
            problems.extend(strategy._combinations(where))
        if problems:
            raise StrategyError(problems)
        return strategy

    @classmethod
    def from_yaml(cls, path: str) -> "Strategy":
        """Load a strategy from a YAML file, following its `extends:` chain, and validate it.

        Args:
            path: the YAML file, or the name of a built-in or user profile.

        Returns:
            The validated strategy.

        Raises:
            StrategyError: the file cannot be found or read, is not YAML of a mapping, or holds mistakes (all of
                them at once, of the file and of the files it extends).
        """
        return load_with_chain(path)[0]

    @property
    def called(self) -> str:
        """How messages name it: `strategy 'swin'`, or `the strategy given` for a dict or `Strategy` without a name
        (whose name is the placeholder `custom`)."""
        return called(self.name)

    def to_dict(self) -> Dict[str, Any]:
        """The strategy as a plain dict of the YAML's shape: what logs, caches and the decision record hold.

        Returns:
            Every key, sections as nested dicts (`optimizer`'s hyper-parameters flattened beside its `name` and
            `fused`).
        """
        out = dataclasses.asdict(self)
        opt = out["optimizer"]
        out["optimizer"] = {"name": opt["name"], "fused": opt["fused"], **opt["hyperparameters"]}
        return out

    def _problems(self, where: Where, path: str) -> List[str]:
        if self.grad_accumulation < 1:
            return [f"{where(path + 'grad_accumulation')} must be an integer >= 1, got {self.grad_accumulation}"]
        return []

    def _combinations(self, where: Where) -> List[str]:
        """Keys of a section that only work together, judged once ``extends`` is merged (a child file alone may
        set one of them and inherit the other)."""
        return [problem for key in ("precision", "loader")
                for problem in getattr(self, key)._combinations(where, key + ".")]

    def to_yaml(self) -> str:
        """The strategy as YAML text: a profile file that loads back to the same strategy.

        Returns:
            [to_dict][aiak.strategy.schema.Strategy.to_dict]'s keys in YAML, in the schema's order.
        """
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def called(name: str) -> str:
    """How messages name a strategy of this name (see `Strategy.called`)."""
    return "the strategy given" if name == "custom" else f"strategy {name!r}"


def load_with_chain(spec: Union[str, os.PathLike, Mapping[str, Any]]) -> Tuple[Strategy, "Chain", Dict[str, Any]]:
    """``(strategy, chain, the file's own data)``; raises one `StrategyError` listing every problem."""
    if isinstance(spec, Mapping):
        source, path, data = "<dict>", None, dict(spec)
    elif isinstance(spec, (str, os.PathLike)):
        path = locate(os.fspath(spec), "strategy")
        source, data = str(path), read_yaml(path)
        data.setdefault("name", path.stem)
    else:
        raise StrategyError(f"strategy must be 'auto', a profile name, a YAML path, a dict or an aiak.Strategy, "
                            f"got {type(spec).__name__}")
    chain = Chain()
    merged = chain.resolve(data, source, path, [str(path.resolve())] if path else [])
    try:
        strategy = Strategy.from_dict(merged, source=source, origins=chain.origins,
                                      combinations=not chain.problems)  # a missing parent: only keys can be judged
    except StrategyError as e:
        raise StrategyError(chain.problems + e.problems) from None
    if chain.problems:
        raise StrategyError(chain.problems)
    return strategy, chain, data
