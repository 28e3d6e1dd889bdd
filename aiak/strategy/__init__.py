"""Strategies: the validated schema, built-in profiles, and the resolution used by ``optimize``."""
from aiak.strategy.profiles import list_profiles, load_strategy, profiles_dir
from aiak.strategy.schema import (CommConfig, LoaderConfig, Match, OptimizerConfig, Precision, Strategy,
                                  StrategyError)
from aiak.strategy.select import resolve_strategy, select_strategy

__all__ = ["Strategy", "StrategyError", "Precision", "OptimizerConfig", "LoaderConfig", "CommConfig", "Match",
           "load_strategy", "list_profiles", "profiles_dir", "select_strategy", "resolve_strategy"]
