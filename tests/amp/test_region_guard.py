"""The guard around a hooked module's call (the instance ``_call_impl`` that puts the originals back on a
``KeyboardInterrupt``) runs the module that was called: a copy sharing the module's ``__dict__`` shallowly
(``copy.copy``, the replicas ``nn.DataParallel`` makes with ``_replicate_for_data_parallel``) computes with its
own tensors, not with those of the module it was copied from."""
import copy

import pytest
import torch
from torch import nn

import aiak

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.dtype")


@pytest.mark.parametrize("how", ["copy.copy", "DataParallel replica"])
def test_a_shallow_copy_computes_with_its_own_tensors(how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model, _, _ = aiak.optimize(model, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    x = torch.randn(3, 4)
    expected = model(x).detach()
    first = copy.copy(model[0]) if how == "copy.copy" else model[0]._replicate_for_data_parallel()
    first._parameters = {name: nn.Parameter(torch.zeros_like(p)) for name, p in model[0]._parameters.items()}
    assert torch.equal(first(x), torch.zeros(3, 4))            # its own (zero) weights, not model[0]'s
    assert torch.equal(model(x).detach(), expected)             # the original is untouched
    assert all(p.dtype == torch.float32 and p.abs().sum() > 0 for p in model[0].parameters())
