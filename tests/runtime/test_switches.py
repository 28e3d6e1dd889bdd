"""Global switches: torch.compile applied in place (keys unchanged, same outputs, really compiled)."""
import copy

import torch
from torch import nn

import aiak


class TwoLayer(nn.Module):  # a user-defined module: dynamo traces it (torch.nn's own classes are skipped)
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_compile_in_place_keeps_keys_and_outputs_and_really_compiles(monkeypatch):
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("AIAK_COMPILE_BACKEND", "eager")  # dynamo's real tracing, without inductor's C++ build
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TwoLayer()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = list(model.state_dict())
    model, opt, _ = aiak.optimize(model, opt, strategy={"compile": True})
    x = torch.randn(4, 8)
    out = model(x)
    assert counters["stats"]["unique_graphs"] >= 1  # a graph was captured and compiled
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
    assert list(model.state_dict()) == keys
    out.sum().backward()
    opt.step()
    torch._dynamo.reset()
