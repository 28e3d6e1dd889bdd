"""compile: true with a backend that fails: aiak's model falls back to eager (one warning, same training as
eager), while the process-wide dynamo settings and the user's own torch.compile calls are left alone."""
import copy
import warnings

import pytest
import torch
from torch import nn

import aiak

FAILING = "aiak_test_failing_backend"
SECOND_FAILS = "aiak_test_second_graph_fails"
_second_fails_body = [None]  # dynamo keeps one registration per name and process: the test sets its body


def _failing_backend(gm, example_inputs):
    raise RuntimeError("aiak test backend refuses every graph\nsecond line of the error")


def _register_failing_backend():
    import torch._dynamo

    if FAILING not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=_failing_backend, name=FAILING)


class BNNet(nn.Module):  # a user-defined module (dynamo traces it) with buffers updated in forward
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.fixture
def failing_backend(monkeypatch):
    import torch._dynamo

    _register_failing_backend()
    monkeypatch.setenv("AIAK_COMPILE_BACKEND", FAILING)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_failing_compile_falls_back_to_eager_once_and_trains_like_eager(failing_backend):
    import torch._dynamo

    suppress_before = torch._dynamo.config.suppress_errors
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    model, opt, _ = aiak.optimize(model, opt, strategy={"compile": True})
    assert torch._dynamo.config.suppress_errors == suppress_before  # the global is left alone

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            for m, o in ((model, opt), (ref, ref_opt)):
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
                o.zero_grad()
    fallbacks = [w for w in caught if "torch.compile" in str(w.message) and "runs eager" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert "aiak test backend refuses every graph" in message and "second line" not in message
    assert "AIAK_COMPILE_BACKEND=aot_eager" in message and "compile: false" in message
    assert "in place" not in message  # the graph failed before anything ran: no buffer was updated twice
    assert fallbacks[0].filename == __file__  # attributed to the user's model(x) line
    # same function as eager, bit for bit: parameters and BatchNorm running statistics
    for (k, v), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, r), k
    assert torch._dynamo.config.suppress_errors == suppress_before

    user_fn = torch.compile(lambda t: torch.sin(t) + 1, backend=FAILING)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        user_fn(torch.randn(3))  # the user's own compile errors still surface


def test_a_model_error_under_compile_raises_the_eager_error(failing_backend):
    torch.manual_seed(0)
    model = BNNet()
    model, _, _ = aiak.optimize(model, strategy={"compile": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(4, 5))  # wrong feature size: the user's bug, not the compiler's
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException), type(info.value)
    assert "shapes cannot be multiplied" in str(info.value)
    assert not [w for w in caught if "runs eager" in str(w.message)]


class BreakNet(nn.Module):
    """A graph break after BatchNorm: the first graph runs (updating the running statistics) before the
    second one is compiled."""

    def __init__(self):
        super().__init__()
        self.bn, self.head = nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        x = self.bn(x)
        torch._dynamo.graph_break()
        return self.head(x)


def test_a_compile_failure_after_part_of_the_call_ran_says_what_was_updated_twice(monkeypatch):
    import torch._dynamo

    calls = []

    def second_graph_fails(gm, example_inputs):
        calls.append(gm)
        if len(calls) > 1:
            raise RuntimeError("second graph refused")
        return gm.forward

    if SECOND_FAILS not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=lambda gm, ex: _second_fails_body[0](gm, ex), name=SECOND_FAILS)
    _second_fails_body[0] = second_graph_fails
    monkeypatch.setenv("AIAK_COMPILE_BACKEND", SECOND_FAILS)
    torch._dynamo.reset()
    try:
        model = BreakNet()
        model, _, _ = aiak.optimize(model, strategy={"compile": True})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.randn(4, 8))
        assert len(calls) == 2  # the first graph compiled and ran, the second failed
        message = next(str(w.message) for w in caught if "runs eager" in str(w.message))
        assert "second graph refused" in message
        assert "updated buffers in place" in message and "num_batches_tracked" in message
        assert model.bn.num_batches_tracked.item() == 2  # what the warning discloses: this call counted twice
    finally:
        torch._dynamo.reset()



@pytest.mark.filterwarnings("ignore:aiak. precision.dtype")
def test_compiled_o2_model_trains_like_the_eager_one(monkeypatch):
    """compile: true with O2: the region is traced into the graph (aiak/amp/compiled_region.py), and the compiled
    model's fp32 parameters get the same gradients as the eager model's, bit for bit with the aot_eager backend (an
    early traced swap of parameters for their half copies left every gradient None)."""
    monkeypatch.setenv("AIAK_COMPILE_BACKEND", "aot_eager")
    strategy = {"precision": {"level": "O2", "dtype": "bf16"}}
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    compiled = copy.deepcopy(eager)
    eager, _, _ = aiak.optimize(eager, torch.optim.SGD(eager.parameters(), lr=0.1), strategy=strategy)
    compiled, _, _ = aiak.optimize(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1),
                                   strategy={**strategy, "compile": True})
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for model in (eager, compiled):
        nn.functional.cross_entropy(model(x), y).backward()
    assert compiled._compiled_call_impl is not None  # really compiled (no eager fallback)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert b.grad is not None and torch.equal(a.grad, b.grad)
