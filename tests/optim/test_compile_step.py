"""``torch.compile`` of the default ``Lamb.step`` (issue 14, item 4): it compiles, and equals the eager step.

Eagerly, the default path writes temporaries with ``out=`` into scratch views and runs torch's fused Adam
kernel; dynamo refused both ("mutation on a view chain"). Under compile the step runs as one bucket with
the foreach form of the moments (``aiak.optim._multi_tensor.LayerwiseOptimizer._bucketing``).
"""
import copy

import pytest
import torch
from torch import nn

from aiak.optim import Lamb, Lars


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))


def _train(model, step, opt, steps=4):
    for i in range(steps):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).square().mean().backward()
        step()


@pytest.mark.parametrize("cls,kw", [(Lamb, dict(lr=1e-2, weight_decay=0.01)), (Lamb, dict(lr=1e-2)),
                                    (Lars, dict(lr=1.0, weight_decay=1e-4))], ids=["lamb-decay", "lamb", "lars"])
def test_compiled_step_equals_the_eager_step(cls, kw):
    """aot_eager runs the same ops in fp32: weights and moments equal to 1e-6 of each tensor's largest value
    (4 steps), and they moved (a compiled step that did nothing would fail).

    The eager step runs torch's fused Adam kernel, the compiled one the foreach form: they round differently, so
    an element far below its tensor's scale differs by an ulp of the scale, not of itself (a moment of 4e-5 in a
    tensor reaching 8e-3 differed by 1e-9 on one machine)."""
    torch._dynamo.reset()
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    start = [p.detach().clone() for p in eager_model.parameters()]
    eager = cls(eager_model.parameters(), **kw)
    compiled = cls(compiled_model.parameters(), **kw)
    _train(eager_model, eager.step, eager)
    _train(compiled_model, torch.compile(compiled.step, backend="aot_eager"), compiled)
    for a, b, s in zip(compiled_model.parameters(), eager_model.parameters(), start):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
        assert not torch.equal(b, s)
    for pa, pb in zip(compiled_model.parameters(), eager_model.parameters()):
        for key, value in eager.state[pb].items():
            if torch.is_tensor(value):
                scale = value.abs().max().item()
                torch.testing.assert_close(compiled.state[pa][key], value, rtol=1e-6, atol=1e-6 * scale)


def test_eager_step_still_takes_the_bucketed_path():
    """Outside compile nothing changed: the plan cache holds the step's buckets."""
    model = _model()
    opt = Lamb(model.parameters(), lr=1e-2)
    _train(model, opt.step, opt, steps=1)
    assert len(opt._plans._plans) == 1
