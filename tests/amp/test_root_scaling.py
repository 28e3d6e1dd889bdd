"""fp16 loss scaling at the root of each backward pass (:mod:`aiak.amp.scaling.root_scaling`): what it scales, what it leaves
alone, and that it can be undone. The conformance catalogue (``test_conformance.py``) checks the scripts' idioms
against autocast + GradScaler; these tests pin the mechanism itself."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import aiak
from aiak.amp.scaling import root_scaling

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.dtype")
FP16 = {"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 1024}}


def _fp16_model(seed=0, level="O2"):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    strategy = {"precision": {**FP16["precision"], "level": level}}
    model, optimizer, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    return model, optimizer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_root_is_multiplied_inside_and_every_gradient_divided_on_landing(level):
    """Inside the fp16 model the gradient flowing back is 1024x the true one (what keeps small gradients out of
    fp16's underflow); on the parameters' ``.grad`` and on a non-parameter leaf it is the true one again. O1 swaps
    no parameter, so its region hands them to root scaling itself: without that its passes went unscaled."""
    model, _ = _fp16_model(level=level)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 6)
    inside, reference = [], []

    def record_into(grads):
        def hook(module, args, out):
            out.register_hook(lambda g: grads.append(g.float()))
        return hook

    model[1].register_forward_hook(record_into(inside))
    plain[1].register_forward_hook(record_into(reference))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xa).sum().backward()
    plain(xb).sum().backward()
    torch.testing.assert_close(inside[0], 1024 * reference[0], rtol=2e-2, atol=1e-2)   # scaled inside
    torch.testing.assert_close(xa.grad, xb.grad, rtol=2e-2, atol=1e-3)                  # true on a leaf input
    for p, q in zip(model.parameters(), plain.parameters()):                            # true on .grad
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-3)


def test_a_backward_that_reaches_no_fp16_model_is_left_as_it_is():
    """With an fp16 model alive, the backward of another model (plain fp32) is not scaled: a hook inside it sees
    the true gradient."""
    _fp16_model()
    other = nn.Linear(4, 1)
    x = torch.randn(5, 4)
    h = other(x)
    seen = []
    h.register_hook(lambda g: seen.append(g.clone()))
    h.sum().backward()
    assert torch.equal(seen[0], torch.ones(5, 1))


def test_autograd_grad_returns_true_gradients_and_accumulates_nothing():
    model, _ = _fp16_model()
    x = torch.randn(4, 6, requires_grad=True)
    gx, gw = torch.autograd.grad(model(x).sum(), [x, model[0].weight])
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    plain.load_state_dict(model.state_dict())
    rx, rw = torch.autograd.grad(plain(x).sum(), [x, plain[0].weight])
    torch.testing.assert_close(gx, rx, rtol=2e-2, atol=1e-3)   # fp16 compute: 11 bits of mantissa
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=1e-3)
    assert model[0].weight.grad is None and x.grad is None


def test_unwatch_puts_torchs_function_back_and_watch_installs_it_again():
    _fp16_model()
    wrapper = torch.autograd.graph._engine_run_backward
    assert wrapper.__wrapped__ is root_scaling._run_backward and torch.autograd._engine_run_backward is wrapper
    root_scaling.unwatch()
    try:
        original = torch.autograd.graph._engine_run_backward
        assert original is not wrapper and torch.autograd._engine_run_backward is original
        assert original.__module__ == "torch.autograd.graph"
    finally:
        root_scaling.watch()
    assert torch.autograd.graph._engine_run_backward.__wrapped__ is root_scaling._run_backward


def test_the_gpu_checks_root_scaling_row_holds_on_cpu():
    """``benchmarks/gpu_check.py``'s row (an aux loss, reentrant checkpointing and a gradient penalty in one loss,
    O2 fp16 against fp32) run on this CPU, so the row a GPU runs is known to pass where the math is the same."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "precision_cpu.py"
    spec = importlib.util.spec_from_file_location("precision_cpu_for_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    row = module.root_scaling_row(torch.device("cpu"))
    assert row["ok"], row


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_gpu_checks_counted_items_row_holds_on_cpu(dtype):
    """``benchmarks/gpu_check.py``'s counted-items rows (accumulation averaged by tensor counts under O1 with loss
    scaling, against one fp32 big batch per window), run on this CPU."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "precision_cpu.py"
    spec = importlib.util.spec_from_file_location("precision_cpu_for_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    row = module.counted_items_row(torch.device("cpu"), dtype)
    assert row["ok"], row


class _Gate(torch.autograd.Function):
    """Identity whose backward calls ``model.gate()`` (to hold one thread's backward pass at a chosen point)."""

    @staticmethod
    def forward(ctx, x, model):
        ctx.model = model
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.model.gate is not None:
            ctx.model.gate()
        return grad, None


class _CheckpointedNet(nn.Module):
    """stem -> a block under reentrant activation checkpointing (a backward pass of its own, nested in the outer
    one) -> a gate -> head."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(8, 8), nn.Linear(8, 2)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.gate = None

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, torch.tanh(self.stem(x)), use_reentrant=True)
        return self.head(_Gate.apply(h, self))


@pytest.mark.filterwarnings("ignore:aiak")
def test_two_threads_backward_passes_with_nested_checkpoint_passes_keep_their_own_factors():
    """Two fp16 models with other loss scales (1024, 65536), each trained in its own thread, their backward passes
    in flight at once: a checkpoint's nested pass takes the factors of the pass it runs inside, not those of the
    other thread's (the list of passes in flight was one list for the process: the nested pass of one model used
    the other's scale, and each thread popped the other's entry). The gradients equal each model's trained alone."""
    import threading

    def build(scale):
        torch.manual_seed(0)
        model = _CheckpointedNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16",
                                                                          "loss_scale": scale}})
        return model

    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))

    def backward(model):
        nn.functional.cross_entropy(model(x), y).backward()

    alone = {}
    for scale in (1024, 65536):
        model = build(scale)
        backward(model)
        alone[scale] = [p.grad.clone() for p in model.parameters()]

    a, b = build(1024), build(65536)
    a_waiting, b_in_flight, a_done = threading.Event(), threading.Event(), threading.Event()
    failures = []

    def gate_a():  # A's pass is in flight; wait until B's is too, then go on into A's checkpoint
        a_waiting.set()
        assert b_in_flight.wait(30), "B's backward never started"

    def gate_b():  # B's pass is in flight: let A go on, and stay in flight until A is done
        b_in_flight.set()
        assert a_done.wait(30), "A's backward never finished"

    a.gate, b.gate = gate_a, gate_b

    def run(model, after=None, before=None):
        try:
            if before is not None:
                assert before.wait(30), "the other thread never started"
            backward(model)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)
            b_in_flight.set()
            a_done.set()
        finally:
            if after is not None:
                after.set()

    threads = [threading.Thread(target=run, args=(a, a_done)), threading.Thread(target=run, args=(b, None, a_waiting))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not failures, failures
    for model, scale in ((a, 1024), (b, 65536)):
        for p, want in zip(model.parameters(), alone[scale]):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0)
