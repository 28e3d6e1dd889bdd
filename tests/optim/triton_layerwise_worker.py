"""Runs LAMB and LARS through their Triton kernels under TRITON_INTERPRET=1 and saves the weights they reach.

Started as a subprocess by test_triton_layerwise.py, so the interpreter flag (read by triton when the kernels are
decorated) never reaches the rest of the pytest session. The interpreter's fp32 -> bf16 cast truncates where a GPU
rounds to nearest even; tests/ops/triton_interpreter_bf16.py repairs it first (and says why), as for the window
attention's kernels. Each case of ``test_triton_layerwise.CASES`` trains
``fused=True`` on CPU tensors from the problems of test_lamb.py / test_lars.py; the weights, and how many times the
Triton passes and the torch paths ran, go to the file named by argv[1] (``torch.save``). The test computes the
references and compares.
"""
import importlib
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import test_triton_layerwise as cases  # noqa: E402  (beside this file, which runs as a script)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ops"))
import triton_interpreter_bf16  # noqa: E402

print("INTERPRETER_BF16", triton_interpreter_bf16.patch(), flush=True)
from aiak.optim._triton import layerwise  # noqa: E402

# the modules (``aiak.optim.lamb`` the attribute is the function of that name)
lamb, lars = importlib.import_module("aiak.optim.lamb"), importlib.import_module("aiak.optim.lars")

calls = {"triton": 0, "torch": 0}


def _counted(module, name, kind):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[kind] += 1
        return real(*args, **kwargs)

    setattr(module, name, counted)


for name in ("lamb_moments", "lars_apply"):
    _counted(layerwise, name, "triton")
for module, names in ((lamb, ("_multi_tensor_lamb", "_single_tensor_lamb")),
                      (lars, ("_multi_tensor_lars", "_single_tensor_lars"))):
    for name in names:
        _counted(module, name, "torch")

results = {}
for case in cases.CASES:
    calls.update(triton=0, torch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # fused=True warns where the kernels cannot run: here they must
        params = cases.train(case, fused=True)
    results[case["id"]] = {"params": [p.detach().clone() for p in params], **calls}
    print(case["id"], calls, flush=True)
torch.save(results, sys.argv[1])
