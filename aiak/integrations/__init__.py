"""aiak inside the frameworks people train with: one line in a Lightning, Hugging Face Trainer or Accelerate
script.

* `aiak.integrations.lightning`: ``Trainer(callbacks=[AiakCallback(strategy)])``;
* `aiak.integrations.transformers`: ``Trainer(callbacks=[AiakTrainerCallback(strategy)])``, or the
  ``optimizers=`` recipe;
* `aiak.integrations.accelerate`: ``prepare(accelerator, model, optimizer, loader, strategy=...)``.

Nothing here is imported by ``import aiak``; each of those three imports its framework when it is imported.
What the core must know of the frameworks without importing them (their own accumulation, their optimizer
wrappers, their DDP) is in `aiak.step`.
"""
