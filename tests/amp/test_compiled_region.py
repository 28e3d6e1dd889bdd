"""O1/O2 under ``torch.compile``: aiak's half-precision regions are traced into the model's graph
(:mod:`aiak.amp.compiled_region`), so compiling an optimized model makes no more graphs than compiling the plain
model under ``torch.autocast``, and the compiled model trains as the eager one does.

Before the traced region, each module that owned parameters opened its region in a ``torch.compiler.disable``d
hook: a graph break at every such module (4 residual blocks: 9 graphs where plain autocast made 1). Tolerances:
compiled against eager with the ``aot_eager`` backend (the same kernels) is exact for O1 and within bf16/fp16
rounding (``rtol=1e-2``) for O2, whose compiled region runs its half copies under autocast as well; inductor's
fused kernels round differently, so its checks compare updates by cosine similarity (>= 0.999).
"""
import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn import functional as F

import aiak
from tests.graphs import graph_counts as graphs

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = [("O1", "bf16"), ("O2", "bf16"), ("O1", "fp16"), ("O2", "fp16")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.dtype fp16")


class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1  # state updated in place inside the region: lands in the user's fp32 buffer
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, blocks=4, width=16):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


def optimized(model, level, dtype, **strategy):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": level, "dtype": dtype},
                                                        "tune": False, **strategy})
    return model, opt


def batches(n, width=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, width, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def train(model, call, opt, data, weight=1.0):
    """Steps on ``data``; returns the losses and each step's gradients (as the optimizer saw them)."""
    losses, grads = [], []
    for x, y in data:
        loss = F.cross_entropy(call(x), y) * weight
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


# -- graphs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,dtype", PRECISIONS)
def test_a_compiled_optimized_model_makes_the_graphs_plain_autocast_makes(level, dtype):
    """The issue's repro: 4 residual blocks made 9 graphs (8 breaks) under O1 and O2; plain autocast makes 1."""
    torch.manual_seed(0)
    plain, x = MLP(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        expected = graphs(plain, x)
    model, _ = optimized(copy.deepcopy(plain), level, dtype)
    assert graphs(model, x) == expected == (1, 0)


def test_an_error_after_a_graph_break_inside_the_model_puts_everything_back():
    """A break inside a block (a print, a data-dependent branch) runs part of the model eagerly between graphs: an
    exception raised there leaves the parameters the user's fp32 tensors and no region open (the next call computes
    in half again)."""
    class Breaking(Block):
        fail = False

        def forward(self, x):
            y = super().forward(x)
            torch._dynamo.graph_break()
            if Breaking.fail:
                raise RuntimeError("the user's bug")
            return y

    torch.manual_seed(0)
    model, x = nn.Sequential(Breaking(), Breaking(), nn.Linear(16, 3)), torch.randn(8, 16)
    model, _ = optimized(model, "O2", "bf16")
    compiled = torch.compile(model, backend="aot_eager")
    try:
        Breaking.fail = True
        with pytest.raises(RuntimeError, match="the user's bug"):
            compiled(x)
        Breaking.fail = False
        assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
        assert all(type(t) is nn.Parameter for m in model.modules() for t in m._parameters.values())
        from aiak.amp import compiled_region
        assert compiled_region._depth == 0
        seen = []
        handle = model[2].register_forward_hook(lambda m, a, out: seen.append(a[0].dtype))
        assert compiled(x).dtype == torch.float32
        handle.remove()
        assert seen == [torch.bfloat16]
    finally:
        Breaking.fail = False
        torch._dynamo.reset()


# -- the same training ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,dtype", PRECISIONS)
def test_the_compiled_model_trains_as_the_eager_one(level, dtype):
    """Three SGD steps, ``torch.compile(model, backend="aot_eager")`` against the same aiak model eager: the losses,
    every gradient and the in-place buffer updates agree (exact for O1; O2 within bf16/fp16 rounding)."""
    torch.manual_seed(0)
    init = MLP(blocks=2)
    data = batches(3)
    eager, eager_opt = optimized(copy.deepcopy(init), level, dtype)
    model, opt = optimized(copy.deepcopy(init), level, dtype)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        want_losses, want = train(eager, eager, eager_opt, data)
        got_losses, got = train(model, compiled, opt, data)
    finally:
        torch._dynamo.reset()
    tol = dict(rtol=0, atol=0) if level == "O1" else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got_losses, want_losses, **tol)
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            torch.testing.assert_close(g, w, **tol)
    assert [b.calls.item() for b in model.blocks] == [b.calls.item() for b in eager.blocks] == [3.0, 3.0]
    assert all(p.dtype == torch.float32 and type(p) is nn.Parameter for p in model.parameters())


class BranchingBlock(Block):
    """A block with a data-dependent branch (LayerDrop's kind): dynamo breaks the graph inside it, inside a loop of
    the parent (``nn.Sequential``), and runs the parent's frame without tracing it."""

    def forward(self, x):
        if x.sum() > -1e9:
            x = super().forward(x)
        return x


@pytest.mark.parametrize("level,dtype", [("O2", "bf16"), ("O1", "fp16")])
def test_a_model_dynamo_runs_partly_untraced_trains_as_the_eager_one(level, dtype):
    """Graph breaks inside every block of a ``Sequential``: dynamo runs the ``Sequential``'s frame without tracing
    and compiles each block's ``forward`` as a frame of its own, the region opened around them untraced
    (``compiled_region.region_call_untraced``). Every module computes in the region (each Linear's input is in half
    under O2), and three SGD steps give the eager model's losses, gradients and buffer counts (the tolerances of
    test_the_compiled_model_trains_as_the_eager_one)."""
    torch.manual_seed(0)
    init = nn.Sequential(BranchingBlock(), BranchingBlock(), nn.Linear(16, 3))
    data = batches(3)
    eager, eager_opt = optimized(copy.deepcopy(init), level, dtype)
    model, opt = optimized(copy.deepcopy(init), level, dtype)
    compiled = torch.compile(model, backend="aot_eager")
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)) for m in model.modules()
               if isinstance(m, nn.Linear)]
    try:
        want_losses, want = train(eager, eager, eager_opt, data)
        got_losses, got = train(model, compiled, opt, data)
        calls = [model[i].calls.item() for i in (0, 1)]
        explained = torch._dynamo.explain(compiled)(data[0][0])
    finally:
        for h in handles:
            h.remove()
        torch._dynamo.reset()
    assert explained.graph_break_count > 0      # the untraced path ran
    if level == "O2":
        assert set(seen) == {DTYPES[dtype]}, seen
    tol = dict(rtol=0, atol=0) if level == "O1" else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got_losses, want_losses, **tol)
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            torch.testing.assert_close(g, w, **tol)
    assert calls == [eager[i].calls.item() for i in (0, 1)] == [3.0, 3.0]
    assert all(p.dtype == torch.float32 and type(p) is nn.Parameter for p in model.parameters())
    from aiak.amp import compiled_region
    assert compiled_region._depth == 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_loss_scaling_reaches_a_compiled_model(level):
    """A loss weighted by 1e-6: its fp16 gradients underflow unless the backward is scaled. Compiled, the model's
    parameters are handed to root scaling when the strategy is applied (a traced forward cannot), so every gradient
    is non-zero and equals the eager model's."""
    torch.manual_seed(0)
    init = MLP(blocks=2)
    data = batches(2)
    eager, eager_opt = optimized(copy.deepcopy(init), level, "fp16")
    model, opt = optimized(copy.deepcopy(init), level, "fp16")
    compiled = torch.compile(model, backend="aot_eager")
    try:
        _, want = train(eager, eager, eager_opt, data, weight=1e-6)
        _, got = train(model, compiled, opt, data, weight=1e-6)
    finally:
        torch._dynamo.reset()
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            assert g.abs().max() > 0
            torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inductor_compiled_model_trains_as_the_eager_one(level):
    """The default backend, inductor: three steps; each gradient within cosine 0.999 of the eager model's."""
    torch.manual_seed(0)
    init = MLP(blocks=2)
    data = batches(3)
    eager, eager_opt = optimized(copy.deepcopy(init), level, "bf16")
    model, opt = optimized(copy.deepcopy(init), level, "bf16")
    compiled = torch.compile(model)
    try:
        _, want = train(eager, eager, eager_opt, data)
        _, got = train(model, compiled, opt, data)
    finally:
        torch._dynamo.reset()
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            assert F.cosine_similarity(g.flatten(), w.flatten(), dim=0) > 0.999


def test_a_module_kept_in_fp32_computes_in_fp32_when_compiled():
    """``precision.keep_fp32`` under compile: the kept block computes from fp32 inputs with autocast off (its output
    equals an fp32 computation to fp32 rounding, where a bf16 one would be off by ~1e-2), and its output goes on
    in bf16 as in the eager region."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.exact, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 3)

        def forward(self, x):
            h = self.stem(x)
            self.seen = (h.dtype, self.exact(h))
            return self.head(self.seen[1])

    torch.manual_seed(0)
    model, _ = optimized(Net(), "O2", "bf16", precision={"level": "O2", "dtype": "bf16", "keep_fp32": ["exact"]})
    x = torch.randn(8, 16)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        compiled(x)
    finally:
        torch._dynamo.reset()
    stem_dtype, exact_out = model.seen
    assert stem_dtype == torch.bfloat16 and exact_out.dtype == torch.bfloat16
    with torch.no_grad():
        h = model.stem(x).float()  # the same bf16 stem output, eagerly
        want = F.linear(h, model.exact.weight, model.exact.bias)
    torch.testing.assert_close(exact_out.float(), want.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_blocks_compiled_one_by_one_inside_an_eager_region():
    """``block.compile()`` for each block of an optimized model (how large models are often compiled): the root's
    eager region has swapped the block's tensors already, and the compiled block computes with them as it is."""
    torch.manual_seed(0)
    init = MLP(blocks=2)
    eager, _ = optimized(copy.deepcopy(init), "O2", "bf16")
    model, _ = optimized(copy.deepcopy(init), "O2", "bf16")
    for block in model.blocks:
        block.compile(backend="aot_eager")
    x = torch.randn(8, 16)
    try:
        torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_an_optimized_model(strict):
    """``torch.export`` (what the issue names for deployment) exports the optimized model, which computes what the
    eager one computes."""
    torch.manual_seed(0)
    model, _ = optimized(MLP(blocks=1), "O2", "bf16")
    x = torch.randn(8, 16)
    program = torch.export.export(model, (x,), strict=strict)
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=0)


def test_aiaks_own_compile_makes_one_graph(monkeypatch):
    """``compile: true``: the graphs the backend receives for one forward, counted by a backend of the test's."""
    seen = []

    def counting(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.register_backend(compiler_fn=counting, name="aiak_test_counting")
    monkeypatch.setenv("AIAK_COMPILE_BACKEND", "aiak_test_counting")
    torch.manual_seed(0)
    model, _ = optimized(MLP(), "O2", "bf16", compile=True)
    try:
        model(torch.randn(8, 16))
    finally:
        torch._dynamo.reset()
    assert len(seen) == 1


# -- the zoo ----------------------------------------------------------------------------------------------------

_spec = importlib.util.spec_from_file_location("precision_zoo", ROOT / "benchmarks" / "precision_zoo.py")
zoo = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("precision_zoo", zoo)
_spec.loader.exec_module(zoo)

# Eight architectures of the zoo under O1 and O2 (benchmarks/precision_zoo.py --compiled sweeps all of them): CNNs with
# BatchNorm, depthwise convolutions and LayerNorm2d, a ViT, Swin, an encoder, an encoder-decoder and a decoder with
# RMSNorm and rotary embeddings; and GPT-2, whose own loss breaks dynamo's graph (plain autocast makes 2 graphs):
# under O1 the fp32 cast of its outputs after that break was a third graph of one op, until the casts at a region's
# edge stopped starting frames of their own (compiled_region.never_a_frame). wav2vec2 breaks the graph in its feature
# encoder and at LayerDrop's branch: its encoder layers made 7 graphs where plain autocast makes 6 (O2 bf16, O1 fp16),
# dynamo starting a frame at aiak's guard of each layer until the region opened untraced there
# (compiled_region.region_call_untraced).
# O2 on all ten; O1 (autocast in the region, nothing swapped) where the model breaks the graph itself or is a
# transformer encoder (the sweep in the benchmark has every cell).
ZOO_SUBSET = [(name, "O2 bf16") for name in ("timm:resnet10t", "torchvision:mobilenet_v3_small", "timm:convnext_atto",
                                             "timm:vit_tiny_patch16_224", "torchvision:swin_t", "hf:bert", "hf:bart",
                                             "hf:llama", "hf:gpt2", "hf:wav2vec2")] + \
    [("hf:bert", "O1 bf16"), ("hf:gpt2", "O1 bf16"), ("hf:wav2vec2", "O1 fp16")]
_LIBRARY = {"timm": "timm", "torchvision": "torchvision", "hf": "transformers"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,precision", ZOO_SUBSET)
def test_zoo_architectures_compile_to_no_more_graphs_than_plain_autocast(name, precision):
    pytest.importorskip(_LIBRARY[name.split(":")[0]])
    counted = zoo.compiled_graphs(zoo.CASES[name], precision)
    assert counted["aiak"][0] <= counted["plain"][0], counted


def test_a_compiled_whole_train_step_under_fp16():
    """``torch.compile`` of the whole step (forward, ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``) of
    an O2 fp16 model: no more graphs than the same step of plain autocast + ``GradScaler`` (aiak's backward root and
    step controller run eagerly, as GradScaler's step does; traced, they made 6 graphs where GradScaler makes 2), and
    it trains as the eager step does, an overflowing step skipped and the scale halved alike."""
    torch.manual_seed(0)
    init = MLP(blocks=2)
    data = batches(3)

    def make_step(model, opt):
        def step(x, y, weight):
            loss = F.cross_entropy(model(x), y) * weight
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    plain = copy.deepcopy(init)
    plain_opt, scaler = torch.optim.SGD(plain.parameters(), lr=0.1), torch.amp.GradScaler("cpu")

    def plain_step(x, y, weight):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(plain(x), y) * weight
        scaler.scale(loss).backward()
        scaler.step(plain_opt)
        scaler.update()
        plain_opt.zero_grad()
        return loss

    x, y = data[0]
    expected = graphs(plain_step, x, y, 1.0)
    eager, eager_opt = optimized(copy.deepcopy(init), "O2", "fp16")
    model, opt = optimized(copy.deepcopy(init), "O2", "fp16")
    assert graphs(make_step(model, opt), x, y, 1.0)[0] <= expected[0]
    model, opt = optimized(copy.deepcopy(init), "O2", "fp16")
    compiled_step, eager_step = torch.compile(make_step(model, opt), backend="aot_eager"), make_step(eager, eager_opt)
    try:
        for (x, y), weight in zip(data, (1.0, float("inf"), 1.0)):  # the second step overflows
            compiled_step(x, y, weight)
            eager_step(x, y, weight)
    finally:
        torch._dynamo.reset()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-3)
    scale_of = lambda o: o._aiak_steps.scaler.scale  # noqa: E731
    assert scale_of(opt) == scale_of(eager_opt) < 65536.0
