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


class _Probe(nn.Module):
    """Records how many region frames are open while its ``forward`` runs (one per hooked call on the way in)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.depth = None

    def forward(self, x):
        from aiak.amp import half_compute
        self.depth = len(half_compute._threads.frames)
        return self.lin(x)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_module_inside_a_region_skips_the_hooks_only_when_it_has_none_of_its_own(level):
    """Inside a region a hooked module's own hooks only record the call: it runs as torch runs a module without
    hooks. With a hook of the user's on it, or a global module hook, the hooks run, the user's with them, and the
    result is the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Probe())
    model, _, _ = aiak.optimize(model, strategy={"precision": {"level": level, "dtype": "bf16"}})
    x = torch.randn(3, 4)
    fast = model(x)
    assert model[1].depth == 1                         # the root's frame alone: the probe's hooks did not run
    seen = []
    handle = model[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with_hook = model(x)
    handle.remove()
    assert model[1].depth == 2 and seen == [torch.bfloat16]
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        model(x)
        assert model[1].depth == 2
    finally:
        handle.remove()
    assert torch.equal(fast, with_hook) and fast.dtype == torch.float32
    model[1](x)
    assert model[1].depth == 1                         # called alone it opens the region itself
