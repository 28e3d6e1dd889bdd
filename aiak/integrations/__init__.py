"""aiak inside the frameworks people train with: one line in a Lightning, Hugging Face Trainer or Accelerate
script.

* :mod:`aiak.integrations.lightning`: ``Trainer(callbacks=[AiakCallback(strategy)])``;
* :mod:`aiak.integrations.transformers`: ``Trainer(callbacks=[AiakTrainerCallback(strategy)])``, or the
  ``optimizers=`` recipe;
* :mod:`aiak.integrations.accelerate`: ``prepare(accelerator, model, optimizer, loader, strategy=...)``.

Nothing here is imported by ``import aiak``; each of those three imports its framework when it is imported.
:mod:`aiak.integrations.stacking` (is a framework accumulating?) and :mod:`aiak.integrations.wrappers` (the
optimizer inside a framework's wrapper) import no framework: the step controller and ``optimize()`` use them.
"""
