"""aiak: make an existing PyTorch training script faster with one call.

    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy="auto")

Importing aiak needs only torch and PyYAML: subpackages are loaded on first use, optional dependencies
(triton, nvidia-dali, apex) only inside the functions that need them, and CUDA is never touched here.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "optimize": ("aiak.api", "optimize"),
    "Strategy": ("aiak.strategy.schema", "Strategy"),
    "StrategyError": ("aiak.strategy.schema", "StrategyError"),
    "load_strategy": ("aiak.strategy.profiles", "load_strategy"),
    "select_strategy": ("aiak.strategy.select", "select_strategy"),
    "last_decision": ("aiak.api", "last_decision"),
    "clip_grad_norm_": ("aiak.step.controller", "clip_grad_norm_"),
    "clip_grad_value_": ("aiak.step.controller", "clip_grad_value_"),
    "stepped": ("aiak.step.controller", "stepped"),
    "count_items": ("aiak.step.controller", "count_items"),
    "patches": ("aiak.runtime.patches", "patches"),
    "undo_patches": ("aiak.runtime.patches", "undo_patches"),
}
_SUBPACKAGES = ("amp", "comm", "loaders", "ops", "optim", "strategy", "tune", "cli")

__all__ = list(_LAZY) + list(_SUBPACKAGES)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"aiak.{name}")
    raise AttributeError(f"module 'aiak' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
