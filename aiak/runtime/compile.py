"""``compile: true``: ``torch.compile`` in place, falling back to eager for this model alone when it fails.

Setting ``torch._dynamo.config.suppress_errors`` would also keep a failing compile from stopping the run,
but it is process-wide: it would hide compile errors in the user's own ``torch.compile`` calls too. So the
global is left alone and aiak's compiled call catches dynamo/inductor errors itself
(``torch._dynamo.exc.TorchDynamoException``, which ``InductorError`` and ``BackendCompilerFailed`` derive
from): it runs the eager forward for that call; if eager succeeds the compiler was at fault, so it warns
once, with the error's first line and what to try, and the model stays eager from then on; if eager raises
too, the model itself is wrong and eager's exception is what the user gets.

A compiled call can fail after part of it ran (a graph break, then a second graph that does not compile):
buffers it already updated in place (BatchNorm running statistics) are then updated again by the eager
rerun. That is detected from the buffers' version counters (BatchNorm's kernel updates its running
statistics without bumping theirs, but its ``num_batches_tracked`` counts every update) and said in the
warning.

Not covered: a backward graph that only fails to compile during ``loss.backward()`` (AOT autograd compiles
it lazily); that error propagates from ``backward()``.
"""
from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from aiak.util.warn import warn


def apply_compile(model: nn.Module, device: torch.device) -> str:
    """``torch.compile`` in place (``Module.compile``), so state_dict keys keep the user's names.

    The backend is inductor unless the environment variable ``AIAK_COMPILE_BACKEND`` names another
    (``aot_eager`` or ``eager`` help to tell a compiler problem from a model problem).
    """
    backend = os.environ.get("AIAK_COMPILE_BACKEND", "inductor")
    if device.type == "cpu" and backend == "inductor" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        warn("aiak: compile requested but no C++ compiler is on PATH (inductor needs one on CPU): skipped")
        return "skipped (no C++ compiler for inductor)"
    if not hasattr(model, "compile"):
        warn("aiak: compile requested but this torch has no Module.compile: skipped")
        return "skipped (torch too old)"
    model.compile(backend=backend)
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:  # Module.compile stores torch.compile(self._call_impl) there (torch >= 2.2)
        return f"on (torch.compile in place, backend {backend}; compile errors are raised)"
    model._compiled_call_impl = _EagerFallback(model, compiled, backend)
    return f"on (torch.compile in place, backend {backend}; a compile error makes this model run eager, with a warning)"


class _EagerFallback:
    """Stands in ``module._compiled_call_impl``: the compiled call, or the eager one after a compile error."""

    __slots__ = ("module", "compiled", "backend", "buffers")

    def __init__(self, module: nn.Module, compiled, backend: str):
        self.module, self.compiled, self.backend = module, compiled, backend
        # Listed once: walking the module tree on every forward cost ~130 us for a ResNet-50 (reading the
        # version counters of a kept list, ~7 us). Only the warning's "updated twice" note reads them.
        self.buffers = list(module.buffers())

    def __call__(self, *args, **kwargs):
        from torch._dynamo.exc import TorchDynamoException

        versions = [b._version for b in self.buffers]
        try:
            return self.compiled(*args, **kwargs)
        except TorchDynamoException as e:
            error = e
        updated = any(b._version != v for b, v in zip(self.buffers, versions))
        out = self.module._call_impl(*args, **kwargs)  # if this raises, the model itself is wrong: that is the error
        self.module._compiled_call_impl = None  # Module.__call__ now runs eager for good
        twice = (" The failed call had already run part of the model and updated buffers in place (e.g. BatchNorm "
                 "running statistics and num_batches_tracked); this call's eager rerun updated them once more."
                 if updated else "")
        warn(f"aiak: torch.compile (backend {self.backend}) failed for {type(self.module).__name__}, which runs "
             f"eager from now on: {_first_lines(error)}. To find the cause, try "
             "AIAK_COMPILE_BACKEND=aot_eager or AIAK_COMPILE_BACKEND=eager, or set compile: false." + twice)
        return out


def _first_lines(error: BaseException) -> str:
    """``Type: first line`` of the error, and of the error inside it (what the backend itself raised)."""
    def first(e: BaseException) -> str:
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"{type(e).__name__}: {line}" if line else type(e).__name__

    inner = getattr(error, "inner_exception", None) or error.__cause__
    return first(error) + (f" {first(inner)}" if inner is not None else "")
