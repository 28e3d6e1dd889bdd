"""The DistributedDataParallel a framework has already wrapped the model in, before ``aiak.optimize`` saw it.

Lightning's DDP strategy wraps the LightningModule in DDP (``trainer.strategy.model``) and only then calls
``configure_optimizers``, where ``AiakCallback`` (or the user) calls ``aiak.optimize(self, optimizer)`` with the
bare module. A second DDP built there would never be trained through: aiak's communication settings would apply
to it alone, and accumulation would switch off the synchronisation of a wrapper nobody calls. So ``optimize()``
asks here, and treats the framework's DDP as one the script built: its communication hook is registered on it,
and accumulation's ``no_sync`` switches it.

Only modules already imported are looked at (``sys.modules``): this never imports a framework.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from torch import nn

_LIGHTNING_MODULES = ("pytorch_lightning", "lightning.pytorch")


def framework_ddp(model: Any) -> Optional[nn.parallel.DistributedDataParallel]:
    """The DDP wrapping ``model`` that a framework built and trains through, or None."""
    for name in _LIGHTNING_MODULES:
        module_cls = getattr(sys.modules.get(name), "LightningModule", None)
        if module_cls is not None and isinstance(model, module_cls):
            strategy = getattr(getattr(model, "_trainer", None), "strategy", None)
            wrapper = getattr(strategy, "model", None)
            if isinstance(wrapper, nn.parallel.DistributedDataParallel) and wrapper.module is model:
                return wrapper
    return None
