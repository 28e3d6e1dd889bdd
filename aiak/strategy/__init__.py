"""Strategies: the validated schema, the YAML profiles, the ``match:`` rules and the probes they are evaluated
against, and the resolution used by ``optimize`` (``"auto"`` composed from the rules)."""
from aiak.strategy.probes import MODULE_KINDS, Probes, probe
from aiak.strategy.profile_files import list_profiles, profiles_dir, user_profile_dirs
from aiak.strategy.profiles import load_strategy
from aiak.strategy.rules import match_profile
from aiak.strategy.schema import (CommConfig, LoaderConfig, Match, OptimizerConfig, Precision, Strategy,
                                  StrategyError, TuneConfig)
from aiak.strategy.select import Knob, Selection, compose, resolve_strategy, select, select_strategy

__all__ = ["Strategy", "StrategyError", "Precision", "OptimizerConfig", "LoaderConfig", "CommConfig", "Match",
           "TuneConfig", "load_strategy", "list_profiles", "profiles_dir", "user_profile_dirs", "select_strategy",
           "resolve_strategy", "select", "compose", "Selection", "Knob", "Probes", "probe", "MODULE_KINDS",
           "match_profile"]
