"""aiak in a Hugging Face ``Trainer`` script: one callback, or the ``optimizers=`` recipe.

``AiakTrainerCallback(strategy)`` applies ``aiak.optimize`` when training begins, to the Trainer's model, the
optimizer it built (seen through Accelerate's ``AcceleratedOptimizer``) and its scheduler. What makes the
Trainer's own calls right underneath: ``loss *= ...`` on the model's output is allowed, ``model.zero_grad()``
after each Trainer step keeps aiak's partial sums, ``max_grad_norm`` clips the true gradient (through
``accelerator.clip_grad_norm_`` -> ``torch.nn.utils.clip_grad_norm_``), and with
``TrainingArguments(gradient_accumulation_steps=N)`` as well the Trainer's accumulation wins (one warning).

Schedules count Trainer steps: with aiak's ``grad_accumulation: N`` the scheduler advances once per real step,
but its horizon (``max_steps``) is still in Trainer steps. For a schedule over real steps, use the Trainer's
``gradient_accumulation_steps`` for accumulation, or the recipe below with a scheduler of your own built for the
real number of steps. ``trainer.train(resume_from_checkpoint=...)`` continues where the checkpoint left off: the
Trainer loads the optimizer's state before any callback runs, so what aiak adds to it (the loss scale of
``dtype: fp16``, the position in an accumulation window) is also kept in the callback's entry of
``trainer_state.json`` and taken back when training begins. The callback runs in one process; under torchrun the Trainer has already wrapped the
model in DDP, so use the recipe (aiak's own DDP) there instead.

With aiak's ``grad_accumulation: N`` and the Trainer's ``gradient_accumulation_steps=1``, the callback makes
aiak's windows what the Trainer's own would be: each window closes at the epoch's last batch (``on_step_begin``
tells aiak before that batch's forward), and each micro-batch is weighed by the items the Trainer counted for it
(its ``num_items_in_batch``, the real tokens of a language model's labels, passed to a model that takes loss
keyword arguments: a forward pre-hook hands it to `aiak.count_items`), so a loss that is a mean over tokens
accumulates to the big batch's mean over all its tokens, as the Trainer's own accumulation gives. With the
Trainer's accumulation (``gradient_accumulation_steps > 1``) the Trainer already divides by the window's items;
aiak's accumulation then steps aside and the callback counts nothing, so nothing is weighed twice.

A complete script (callback)::

    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments
    from aiak.integrations.transformers import AiakTrainerCallback

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Samples(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = torch.randn(512, 32), torch.randint(0, 10, (512,))
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=32, num_train_epochs=1,
                             gradient_accumulation_steps=2, report_to=[])
    trainer = Trainer(model=Classifier(), args=args, train_dataset=Samples(),
                      callbacks=[AiakTrainerCallback({"precision": {"level": "O2", "dtype": "bf16"}})])
    trainer.train()

The recipe (``optimizers=``), for your own optimizer and a schedule over real steps::

    model, optimizer, _, scheduler = aiak.optimize(model, optimizer, strategy=..., scheduler=scheduler)
    trainer = Trainer(model=model, args=args, train_dataset=..., optimizers=(optimizer, scheduler))
"""
from __future__ import annotations

from typing import Any

import torch

import aiak
from aiak.util.machine.versions import install_hint
from aiak.step.controller import controller_of
from aiak.util.dist import is_distributed

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as e:
    raise ImportError("aiak.integrations.transformers needs transformers: " + install_hint("transformers")) from e

__all__ = ["AiakTrainerCallback"]


class AiakTrainerCallback(TrainerCallback, ExportableState):
    """``Trainer(callbacks=[AiakTrainerCallback(strategy)])``: ``aiak.optimize`` on the Trainer's model, optimizer and
    scheduler when training begins (after the Trainer built them, before the first batch).

    As an ``ExportableState`` its `state` goes into every checkpoint's ``trainer_state.json``: the strategy
    and aiak's step state (`aiak.step.controller.StepController.checkpoint_extras`), which a resumed run
    takes back after ``optimize``.
    """

    def __init__(self, strategy: Any = "auto"):
        self.strategy = strategy
        self.applied = False
        self._optimizer = None
        self._batches_per_epoch = None  # aiak accumulates over the Trainer's single-batch steps: windows to close
        self._counting = None           # the forward pre-hook counting the Trainer's num_items_in_batch

    def state(self) -> dict:
        """What the Trainer writes into a checkpoint for this callback (plain JSON values)."""
        strategy = self.strategy.to_dict() if hasattr(self.strategy, "to_dict") else self.strategy
        controller = controller_of(self._optimizer) if self._optimizer is not None else None
        return {"args": {"strategy": strategy},
                "attributes": {"checkpoint_extras": controller.checkpoint_extras() if controller else None}}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.applied:
            return
        if is_distributed():
            raise RuntimeError("AiakTrainerCallback runs in a single process: under torchrun the Trainer has already "
                               "wrapped the model in DDP. Use the optimizers= recipe of aiak.integrations.transformers "
                               "(aiak.optimize before building the Trainer) instead")
        if lr_scheduler is None:
            aiak.optimize(model, optimizer, strategy=self.strategy)
        else:
            aiak.optimize(model, optimizer, strategy=self.strategy, scheduler=lr_scheduler)
        self.applied = True
        self._optimizer = optimizer
        extras = _saved_extras(state, type(self).__name__)
        controller = controller_of(optimizer)
        if extras is not None and controller is not None:  # resumed: the Trainer loaded the optimizer without them
            controller.restore_checkpoint_extras(extras)
        if controller is not None and controller.accumulation > 1 and args.gradient_accumulation_steps == 1:
            self._take_over_the_trainers_windows(model, controller, kwargs.get("train_dataloader"))

    def _take_over_the_trainers_windows(self, model, controller, loader) -> None:
        """aiak accumulates over the Trainer's one-batch steps: close its windows where the Trainer's epochs end,
        and weigh each micro-batch by the items the Trainer counts for it."""
        try:
            self._batches_per_epoch = len(loader) if loader is not None else None
        except TypeError:
            self._batches_per_epoch = None
        controller.sees_epoch_ends = self._batches_per_epoch is not None
        self._counting = model.register_forward_pre_hook(self._count_items, with_kwargs=True)

    def _count_items(self, module, args, kwargs):
        """A training forward the Trainer passed ``num_items_in_batch`` to: that micro-batch's items."""
        n = kwargs.get("num_items_in_batch")
        if n is not None and module.training and torch.is_grad_enabled():
            aiak.count_items(self._optimizer, n)

    def on_step_begin(self, args, state, control, **kwargs):
        """Before the epoch's last batch (the Trainer steps once per batch here), aiak's window closes with it."""
        batches = self._batches_per_epoch
        if batches and (state.global_step + 1) % batches == 0:
            controller_of(self._optimizer).close_window()

    def on_train_end(self, args, state, control, **kwargs):
        if self._counting is not None:
            self._counting.remove()
            self._counting = None


def _saved_extras(state, name: str):
    """This callback's ``checkpoint_extras`` in a resumed ``TrainerState`` (None in a fresh run: the entry
    there was written before ``optimize``)."""
    saved = (getattr(state, "stateful_callbacks", None) or {}).get(name)
    if isinstance(saved, list):  # the Trainer keeps a list when several callbacks share the class
        saved = saved[0] if saved else None
    return (saved or {}).get("attributes", {}).get("checkpoint_extras")
