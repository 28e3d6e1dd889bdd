"""aiak in a PyTorch Lightning script: one callback.

``AiakCallback(strategy)`` applies ``aiak.optimize`` to the LightningModule and the optimizer its
``configure_optimizers`` returns, at the moment Lightning asks for it (after the module is on its device), and
hands Lightning back the same structure (optimizer, ``{"optimizer", "lr_scheduler"}`` dict, or lists). A
scheduler goes through ``aiak.optimize(scheduler=...)``, so with ``grad_accumulation`` it advances once per real
step. Lightning steps with ``optimizer.step(closure)`` and clips with ``torch.nn.utils.clip_grad_norm_`` inside
that closure; both reach aiak's step controller, which clips the true gradient (unscaled, the whole window's
average). With ``Trainer(accumulate_grad_batches=N)`` as well, Lightning's accumulation wins (one warning).
With aiak's ``grad_accumulation`` alone, the callback closes aiak's window at each epoch's last batch (Lightning's
``num_training_batches``, told before that batch's forward), averaged over the micro-batches it holds as timm's
``train.py`` does (Lightning's own accumulation divides a short last window by ``accumulate_grad_batches``).

A complete script::

    import pytorch_lightning as pl
    import torch
    from torch import nn
    from aiak.integrations.lightning import AiakCallback

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)   # self.net(x) works the same

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,)))
    trainer = pl.Trainer(max_epochs=1, gradient_clip_val=1.0,
                         callbacks=[AiakCallback({"precision": {"level": "O2", "dtype": "bf16"},
                                                  "grad_accumulation": 2})])
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=32))

``training_step`` may compute the loss from ``self(x)`` or from a submodule (``self.net(x)``): aiak's precision
hooks sit on every module that owns parameters, so either computes in half precision, the fp16 loss scale is
undone as each gradient lands, and gradient accumulation divides at the real step.

Calling ``aiak.optimize(self, optimizer, strategy=...)`` inside ``configure_optimizers`` yourself is the same
thing. Several optimizers (a GAN's generator and discriminator) each go through it: the first call applies the
strategy to the module, each further call (and every call when ``configure_optimizers`` runs again, for a second
``fit`` or after ``Tuner.lr_find``) gives its optimizer its own stepping on the module as the first call left it.
"""
from __future__ import annotations

import math
from typing import Any

import aiak
from aiak.step.controller import controller_of
from aiak.runtime.marks import mark, marked
from aiak.util.machine.versions import install_hint

try:
    import pytorch_lightning as pl
except ImportError:  # the ``lightning`` umbrella package
    try:
        import lightning.pytorch as pl
    except ImportError as e:
        raise ImportError("aiak.integrations.lightning needs PyTorch Lightning: "
                          + install_hint("pytorch-lightning")) from e

__all__ = ["AiakCallback", "optimize_configuration"]


def optimize_configuration(module, configuration: Any, strategy: Any = "auto") -> Any:
    """``configure_optimizers``'s return value with each optimizer (and its scheduler) passed through
    ``aiak.optimize(module, ...)``, in the same shape: an optimizer, a ``{"optimizer", "lr_scheduler"}`` dict, a
    list of either, or ``([optimizers], [schedulers])``. The first optimizer's call applies the strategy to the
    module; each further one (several optimizers, or a second ``fit``) gets its own stepping on the same module."""
    if isinstance(configuration, dict):
        scheduler_entry = configuration.get("lr_scheduler")
        scheduler = scheduler_entry.get("scheduler") if isinstance(scheduler_entry, dict) else scheduler_entry
        optimizer, scheduler = _optimize(module, configuration["optimizer"], scheduler, strategy)
        out = dict(configuration, optimizer=optimizer)
        if isinstance(scheduler_entry, dict):
            out["lr_scheduler"] = dict(scheduler_entry, scheduler=scheduler)
        elif scheduler_entry is not None:
            out["lr_scheduler"] = scheduler
        return out
    if isinstance(configuration, (list, tuple)):
        if len(configuration) == 2 and all(isinstance(c, (list, tuple)) for c in configuration):
            optimizers, schedulers = configuration
            done = [_optimize(module, opt, _scheduler_of(opt, schedulers), strategy) for opt in optimizers]
            by_old = {id(old): new for old, new in zip(schedulers, _schedulers_of(schedulers, optimizers, done))}
            return [opt for opt, _ in done], [by_old[id(s)] for s in schedulers]
        return [optimize_configuration(module, c, strategy) for c in configuration]
    return _optimize(module, configuration, None, strategy)[0]


def _scheduler_of(optimizer, schedulers):
    """The one scheduler (a scheduler object or Lightning's ``{"scheduler": ...}`` dict) driving ``optimizer``."""
    for s in schedulers:
        if getattr(s.get("scheduler") if isinstance(s, dict) else s, "optimizer", None) is optimizer:
            return s.get("scheduler") if isinstance(s, dict) else s
    return None


def _schedulers_of(schedulers, optimizers, done):
    """``schedulers`` as ``aiak.optimize`` returned them (a dict entry keeps its other keys)."""
    returned = {id(_scheduler_of(opt, schedulers)): sched for opt, (_, sched) in zip(optimizers, done)}
    out = []
    for s in schedulers:
        inner = s.get("scheduler") if isinstance(s, dict) else s
        new = returned.get(id(inner), inner)
        out.append(dict(s, scheduler=new) if isinstance(s, dict) else new)
    return out


def _optimize(module, optimizer, scheduler, strategy):
    if scheduler is None:
        _, optimizer, _ = aiak.optimize(module, optimizer, strategy=strategy)
        return optimizer, None
    _, optimizer, _, scheduler = aiak.optimize(module, optimizer, strategy=strategy, scheduler=scheduler)
    return optimizer, scheduler


class AiakCallback(pl.Callback):
    """``Trainer(callbacks=[AiakCallback(strategy)])``: aiak applied to the module's optimizer at fit time."""

    def __init__(self, strategy: Any = "auto"):
        self.strategy = strategy
        self._closing = []  # step controllers whose windows close at each epoch's last batch

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or marked(pl_module, "_aiak_callback_wrapped", False):
            return
        configure = pl_module.configure_optimizers
        strategy = self.strategy

        def configure_optimizers():
            return optimize_configuration(pl_module, configure(), strategy)

        pl_module.configure_optimizers = configure_optimizers
        mark(pl_module, "_aiak_callback_wrapped", True)

    def on_train_start(self, trainer, pl_module) -> None:
        """The controllers that accumulate, told that their windows will close with Lightning's epochs."""
        controllers = [controller_of(o) for o in trainer.optimizers]
        self._closing = [c for c in controllers if c is not None and c.accumulation > 1] \
            if math.isfinite(trainer.num_training_batches) else []
        for controller in self._closing:
            controller.sees_epoch_ends = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == trainer.num_training_batches - 1:
            for controller in self._closing:
                controller.close_window()
