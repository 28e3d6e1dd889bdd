"""aiak in a Hugging Face Accelerate script: ``prepare`` in the supported order.

``prepare(accelerator, model, optimizer, loader, strategy=..., scheduler=...)`` puts the model on the
accelerator's device, applies ``aiak.optimize``, then ``accelerator.prepare`` on everything, and returns the objects in the order given, as
``accelerator.prepare`` does. The loader goes to Accelerate only (it shards and places batches itself).

Both orders work in one process (``aiak.optimize`` sees through an ``AcceleratedOptimizer``):
``accelerator.accumulate()`` with ``Accelerator(gradient_accumulation_steps=N)`` wins over aiak's
``grad_accumulation`` (one warning), and ``accelerator.clip_grad_norm_`` clips the true gradient (it calls
``torch.nn.utils.clip_grad_norm_``, which reaches aiak's step controller). Several processes are refused:
Accelerate and aiak would each wrap the model in DDP; under torchrun use aiak alone.

A complete script::

    import torch
    from torch import nn
    from accelerate import Accelerator
    from aiak.integrations.accelerate import prepare

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 10, (512,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader,
                                       strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
"""
from __future__ import annotations

from typing import Any

import aiak
from aiak.util.machine.versions import install_hint

try:
    import accelerate  # noqa: F401  (the dependency this module is about)
except ImportError as e:
    raise ImportError("aiak.integrations.accelerate needs accelerate: " + install_hint("accelerate")) from e

__all__ = ["prepare"]


def prepare(accelerator, model, optimizer, loader=None, *, strategy: Any = "auto", scheduler=None):
    """``aiak.optimize`` then ``accelerator.prepare``: returns ``(model, optimizer[, loader][, scheduler])``."""
    if accelerator.num_processes > 1:
        raise RuntimeError(f"aiak.integrations.accelerate.prepare: {accelerator.num_processes} processes: Accelerate "
                           "and aiak would each wrap the model in DistributedDataParallel. Under torchrun use "
                           "aiak.optimize alone (it wraps DDP and sets the communication hook)")
    model.to(accelerator.device)
    if scheduler is None:
        model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy, device=accelerator.device)
    else:
        model, optimizer, _, scheduler = aiak.optimize(model, optimizer, strategy=strategy, scheduler=scheduler,
                                                       device=accelerator.device)
    objects = [model, optimizer] + [o for o in (loader, scheduler) if o is not None]
    return tuple(accelerator.prepare(*objects))
