"""aiak inside the frameworks people train with: one line in a Lightning, Hugging Face Trainer or Accelerate
script.

* :mod:`aiak.integrations.lightning`: ``Trainer(callbacks=[AiakCallback(strategy)])``;
* :mod:`aiak.integrations.transformers`: ``Trainer(callbacks=[AiakTrainerCallback(strategy)])``, or the
  ``optimizers=`` recipe;
* :mod:`aiak.integrations.accelerate`: ``prepare(accelerator, model, optimizer, loader, strategy=...)``.

Nothing here is imported by ``import aiak``; each of those three imports its framework when it is imported.
What the core must know of the frameworks without importing them (their own accumulation, their optimizer
wrappers, their DDP) is in :mod:`aiak.step`.
"""
