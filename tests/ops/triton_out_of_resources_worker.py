"""Runs aiak.ops.window_attention under TRITON_INTERPRET=1 with kernel launches that raise triton's real
``OutOfResources``, and prints what happened as JSON (asserted by test_window_attention_fallback.py).

A CPU has no shared memory to exhaust: the interpreter runs any tile. So the launch itself is made to raise
the exception that ``CompiledKernel._init_handles`` raises on a GPU when a kernel needs more shared memory
than the device has, at the place where it comes from: the JIT function's ``run()``, which Triton's
autotuner calls for every config (compiled for sm_90, the fp32 N=256 D=128 forward needs 270,336 bytes at
BLOCK_M=16, an H100/H200 has 232,448). Three scenarios, each on its own shape (the fallback is remembered
per shape): the forward cannot launch; the backward cannot launch; a launch fails with another error,
which must not be taken for a resource limit.
"""
import contextlib
import json
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from aiak.ops._triton import window_attention_kernels as kernels  # noqa: E402
from aiak.ops.window_attention import torch_window_attention, window_attention  # noqa: E402

SHARED_MEMORY_ERROR = OutOfResources(270336, 232448, "shared memory")


class LaunchRecorder:
    """Counts the launches of one autotuned kernel and raises ``error`` from each while it is set."""

    def __init__(self, autotuned):
        self.jit, self.real_run = autotuned.fn, autotuned.fn.run
        self.launches, self.error = 0, None
        self.jit.run = self.run

    def run(self, *args, **kwargs):
        self.launches += 1
        if self.error is not None:
            raise self.error
        return self.real_run(*args, **kwargs)


class WarningRecorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


FWD, BWD = LaunchRecorder(kernels._fwd_kernel), LaunchRecorder(kernels._bwd_kernel)
WARNINGS = WarningRecorder()
logging.getLogger("aiak").addHandler(WARNINGS)


def _inputs(n, d, with_mask, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, d, generator=gen) for _ in range(3))
    bias = torch.randn(2, n, n, generator=gen)
    mask = None
    if with_mask:
        keep = (torch.rand(2, n, n, generator=gen) > 0.3) | torch.eye(n, dtype=torch.bool)
        mask = torch.where(keep, 0.0, -100.0)
    return q, k, v, bias, mask, torch.randn(q.shape, generator=gen)


def _train(fn, q, k, v, bias, mask, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves, mask)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, grad))


def _max_diff(got, want):
    return max((a - b).abs().max().item() for a, b in zip(got, want))


def _calls(n, d, with_mask):
    """Two training calls and one inference call through backend="triton", each compared with the torch
    path, with the kernel launches and aiak warnings that each one caused."""
    q, k, v, bias, mask, grad = _inputs(n, d, with_mask)
    want = _train(torch_window_attention, q, k, v, bias, mask, grad)
    calls = []
    for mode in ("train", "train", "inference"):
        launched, warned = (FWD.launches, BWD.launches), len(WARNINGS.messages)
        if mode == "train":
            got = _train(lambda *a: window_attention(*a, backend="triton"), q, k, v, bias, mask, grad)
            diffs = {"out": _max_diff(got[:1], want[:1]), "grads": _max_diff(got[1:], want[1:])}
        else:
            with torch.no_grad():
                diffs = {"out": _max_diff([window_attention(q, k, v, bias, mask, backend="triton")], want[:1])}
        calls.append({"mode": mode, "diff_vs_torch": diffs,
                      "forward_launches": FWD.launches - launched[0], "backward_launches": BWD.launches - launched[1],
                      "warnings": WARNINGS.messages[warned:]})
    return calls


@contextlib.contextmanager
def _launches_raise(recorder, error):
    recorder.error = error
    try:
        yield
    finally:
        recorder.error = None


def forward_cannot_launch():
    with _launches_raise(FWD, SHARED_MEMORY_ERROR):
        return _calls(256, 128, with_mask=True)


def backward_cannot_launch():
    with _launches_raise(BWD, SHARED_MEMORY_ERROR):
        return _calls(256, 128, with_mask=False)


def other_launch_error():
    q, k, v, bias, mask, _ = _inputs(49, 32, with_mask=True)
    warned = len(WARNINGS.messages)
    raised = None
    with _launches_raise(FWD, RuntimeError("an unrelated launch failure")):
        try:
            window_attention(q, k, v, bias, mask, backend="triton")
        except RuntimeError as err:
            raised = str(err)
    launches = FWD.launches
    out = window_attention(q, k, v, bias, mask, backend="triton")  # not remembered: the kernel runs again
    return {"raised": raised, "warnings": WARNINGS.messages[warned:], "launches_after": FWD.launches - launches,
            "diff_vs_torch": _max_diff([out], [torch_window_attention(q, k, v, bias, mask)])}


def main():
    results = {}
    for scenario in (other_launch_error, forward_cannot_launch, backward_cannot_launch):
        try:
            results[scenario.__name__] = scenario()
        except Exception as exc:  # reported per scenario, so one failure does not hide the others
            results[scenario.__name__] = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
