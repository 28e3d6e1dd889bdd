"""O2 never rounds a value it does not compute in half: norm layers keep their exact fp32 values (right after
optimize(), in state_dict(), and through training steps), and what it does cast comes back exactly."""
import copy

import pytest
import torch
from torch import nn

import aiak

# fp16 cannot hold these (max 65504; 1e-8 is below its smallest subnormal; 1.0001 and 3e-5 round), bf16
# rounds every one of them.
UNHOLDABLE = {"running_var": 1e5, "running_mean": 1e-8, "weight": 1.0001, "bias": 3e-5}
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ScaleNorm(nn.Module):
    """A user's own normalization class: recognised by its name, run in fp32 (input asserted)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.register_buffer("running_mean", torch.zeros(d))
        self.register_buffer("running_var", torch.ones(d))

    def forward(self, x):
        assert x.dtype == torch.float32
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.running_var.mul_(0.9).add_(0.1 * x.var(0))
        return self.weight * (x - self.running_mean) * torch.rsqrt(self.running_var) + self.bias


def _model(kind):
    """The norm layer first (so it sees the model's input exactly), then layers O2 computes in half."""
    conv_head = [nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 4 * 4, 3)]
    linear_head = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)]
    norm, head, shape = {
        "batchnorm": (nn.BatchNorm2d(4), conv_head, (16, 4, 4, 4)),
        "groupnorm": (nn.GroupNorm(2, 4), conv_head, (16, 4, 4, 4)),
        "layernorm": (nn.LayerNorm(4), linear_head, (16, 4)),
        "custom": (ScaleNorm(4), linear_head, (16, 4)),
    }[kind]
    torch.manual_seed(0)
    model = nn.Sequential(norm, *head)
    with torch.no_grad():
        for name, value in UNHOLDABLE.items():
            if hasattr(norm, name):
                getattr(norm, name).fill_(value)
    return model, shape


def _norm_state(model):
    return {k: v.detach().clone() for k, v in model[0].state_dict().items() if v.is_floating_point()}


def _batch(shape, dtype):
    g = torch.Generator().manual_seed(1)
    # values the half dtype holds exactly, so the fp32 reference's norm layer sees the very same input
    x = (torch.randn(shape, generator=g) * 3).to(dtype).float()
    return x, torch.randint(0, 3, (shape[0],), generator=g)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["batchnorm", "groupnorm", "layernorm", "custom"])
def test_norm_values_are_bit_identical_after_optimize_and_in_state_dict(kind, dtype):
    model, _ = _model(kind)
    before = _norm_state(model)
    # the values really cannot survive a round trip through the dtype
    assert any(v.to(HALF[dtype]).float().ne(v).any() for v in before.values())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": dtype}})
    after = _norm_state(model)
    sd = model.state_dict()
    for name, value in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], value), name
        assert sd[f"0.{name}"].dtype == torch.float32 and torch.equal(sd[f"0.{name}"], value), name
    seen = []
    model[1].register_forward_hook(lambda m, a, o: seen.append(m.weight.dtype))
    model(torch.randn(2, *((4, 4, 4) if kind in ("batchnorm", "groupnorm") else (4,))))
    assert seen == [HALF[dtype]]  # the rest of the model computes in half: O2 really applied


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["batchnorm", "groupnorm", "layernorm", "custom"])
def test_norm_update_of_a_training_step_equals_fp32(kind, dtype):
    """Two steps of SGD with momentum and weight decay against plain fp32 PyTorch on the same input.

    Where the math is the same in both runs it must agree to fp32 rounding: the running statistics (computed
    from the norm layer's input, identical in both: rtol 1e-6) and, with a zero loss, the weight-decay update
    of the norm's parameters (bit-identical). With a real loss, the norm's gradients come through the half
    layers after it, so its parameters agree with fp32 to the half dtype's precision: within 2% (fp16) /
    10% (bf16) of the size of their update (measured: <= 0.1% / 1.9%), far below what rounding the start
    values costs (1e-4 of 1.0001, 1e5 -> inf).
    """
    torch_dtype = HALF[dtype]
    for loss_factor in (0.0, 1.0):
        model, shape = _model(kind)
        ref = copy.deepcopy(model)
        start = _norm_state(model)
        make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)  # noqa: E731
        ref_opt = make_opt(ref)
        model, opt, _ = aiak.optimize(model, make_opt(model), strategy={"precision": {"level": "O2", "dtype": dtype}})
        for _ in range(2):
            x, y = _batch(shape, torch_dtype)
            for m, o in ((ref, ref_opt), (model, opt)):
                (nn.functional.cross_entropy(m(x), y) * loss_factor).backward()
                o.step()
                o.zero_grad()
        got, want = _norm_state(model), _norm_state(ref)
        for name in ("running_mean", "running_var"):
            if name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0, msg=name)
        for name in ("weight", "bias"):
            assert got[name].dtype == torch.float32
            if loss_factor == 0.0:
                assert torch.equal(got[name], want[name]), (name, got[name], want[name])
            else:
                update = (want[name] - start[name]).abs().max()
                assert update > 1e-3, "the real loss must move the norm's parameters for this to mean anything"
                tolerance = (0.02 if dtype == "fp16" else 0.1) * update
                assert (got[name] - want[name]).abs().max() <= tolerance, (name, got[name], want[name])


class FrozenAndTable(nn.Module):
    """A frozen pretrained layer and an fp32 buffer outside any norm layer: O2 computes them in half."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("table", torch.full((4,), 1.0001))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.frozen(x) * self.table
        self.product_dtype = h.dtype
        return self.head(h)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_frozen_weights_and_buffers_are_computed_in_half_and_never_rounded(dtype):
    """A frozen layer and an fp32 buffer outside norm layers: half where the forward computes with them (the
    buffer is the user's fp32 tensor, seen in half where it meets a half activation), the user's exact fp32
    tensors everywhere else (state_dict, after a step, after load_state_dict, after an in-place edit)."""
    torch.manual_seed(0)
    model = FrozenAndTable()
    with torch.no_grad():
        model.frozen.weight.add_(1e-4)  # values that round in either half dtype
        model.head.weight.fill_(1.0001)
    exact = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": dtype}})
    seen = []
    model.frozen.register_forward_hook(lambda m, a, o: seen.append((m.weight.dtype, model.table.dtype)))
    assert model.table.dtype == model.frozen.weight.dtype == torch.float32
    sd = model.state_dict()
    for key in ("table", "frozen.weight", "frozen.bias", "head.weight"):
        assert sd[key].dtype == torch.float32 and torch.equal(sd[key], exact[key]), key

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    assert seen == [(HALF[dtype], torch.float32)]  # the frozen layer computed in half; the buffer is the user's
    assert model.product_dtype == HALF[dtype]        # ... and meets the half activation in half
    opt.step()
    sd = model.state_dict()
    for key in ("table", "frozen.weight", "frozen.bias"):  # untouched by the step: still exact
        assert torch.equal(sd[key], exact[key]), key
    assert not torch.equal(sd["head.weight"], exact["head.weight"])  # trained

    new = {k: v + 1e-4 if v.is_floating_point() else v for k, v in exact.items()}
    model.load_state_dict(new)
    sd = model.state_dict()
    for key in ("table", "frozen.weight", "head.weight"):
        assert torch.equal(sd[key], new[key]), key
    with torch.no_grad():
        model.table.fill_(2.0)
    assert torch.equal(model.state_dict()["table"], torch.full((4,), 2.0))


class KeepsATotal(nn.Module):
    """Keeps the running total it reads from a buffer in an attribute for later (a value that outlives the
    forward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("total", torch.full((4,), 1.0001))

    def forward(self, x):
        self.last = self.total.clone()
        return self.lin(x) * self.total


def test_a_buffer_value_kept_past_the_forward_computes_in_fp32_outside_the_region():
    """Outside the forward, the kept value is the plain fp32 tensor it is: adding an fp32 tensor to it is fp32
    arithmetic (inside a region it would meet the half dtype)."""
    model, _, _ = aiak.optimize(KeepsATotal(), strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    model(torch.randn(2, 4))
    later = model.last + torch.zeros(4)
    assert later.dtype == torch.float32 and torch.equal(later, torch.full((4,), 1.0001))
    assert type(later) is torch.Tensor


class FrozenState(nn.Module):
    """A module of the model's own keeping frozen parameters as state, updated in place by its forward: a step
    counter and an exponential average that does not come from the activations (a VQ-VAE codebook's decay
    towards a constant, say), beside a Linear layer that trains."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = nn.Parameter(torch.zeros(()), requires_grad=False)
        self.average = nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.steps += 1
            self.average.mul_(0.99).add_(0.0101)
        return self.lin(x) + self.average


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_frozen_parameters_of_the_models_own_modules_update_in_fp32_arithmetic(dtype):
    """Updated inside the forward, 300 times: the counter is exactly 300 (bf16 stops at 256) and the average is
    what the same updates give in fp32, bit for bit; both stay the user's fp32 parameters."""
    model = FrozenState()
    reference = {"steps": torch.zeros(()), "average": torch.zeros(4)}
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.01)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": dtype}})
    for _ in range(300):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        reference["steps"] += 1
        reference["average"].mul_(0.99).add_(0.0101)
    assert isinstance(model.steps, nn.Parameter) and model.steps.dtype == torch.float32
    assert float(model.steps) == 300.0
    assert torch.equal(model.average, reference["average"])


def test_a_weight_of_the_models_own_class_used_many_times_in_a_forward_is_cast_once():
    """O2 shows the parameters of the model's own module classes as the user's fp32 tensors (RegionState), seen in
    half where they meet half tensors. A recurrent cell uses its weights at every time step: each weight must be cast
    to half once per forward, as the region's half copies of torch's layers are, not once per use (100 casts of each
    weight made the step 4.5x slower). Counted in the autograd graph: one ``ToCopyBackward`` per weight; and the
    gradients are those of the same cell with the casts made once by hand."""
    import warnings

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(0.1 * torch.randn(8, 8))
            self.u = nn.Parameter(0.1 * torch.randn(8, 8))

        def forward(self, x):
            h = torch.zeros(x.shape[0], 8, dtype=x.dtype)
            for t in range(x.shape[1]):
                h = torch.tanh(x[:, t] @ self.w + h @ self.u)
            return h

    torch.manual_seed(0)
    cell = Cell()
    by_hand = Cell()
    by_hand.load_state_dict(cell.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cell, _, _ = aiak.optimize(cell, torch.optim.SGD(cell.parameters(), lr=0.1),
                                   strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    x = torch.randn(4, 20, 8)
    out = cell(x)
    casts, seen, stack = 0, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        casts += type(node).__name__ == "ToCopyBackward0" and any(
            n is not None and type(n).__name__ == "AliasBackward0" for n, _ in node.next_functions)
        stack.extend(n for n, _ in node.next_functions)
    assert casts == 2, f"{casts} casts of the two weights in one forward"
    out.sum().backward()
    w, u = by_hand.w.to(torch.bfloat16), by_hand.u.to(torch.bfloat16)
    h = torch.zeros(4, 8, dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    for t in range(20):
        h = torch.tanh(xb[:, t] @ w + h @ u)
    h.float().sum().backward()
    assert torch.equal(cell.w.grad, by_hand.w.grad) and torch.equal(cell.u.grad, by_hand.u.grad)


def test_hugging_face_conv1d_weights_are_plain_half_copies_and_train_as_through_region_state(monkeypatch):
    """GPT-2's projections are Hugging Face's ``Conv1D`` (``addmm(bias, x, weight)``), a class outside ``torch.nn``
    that uses its parameters as ``nn.Linear`` does: O2 gives them plain half copies (no RegionState dispatch per
    call). Three AdamW steps of a small GPT-2 are bit-identical to the same steps with ``Conv1D`` shown through
    RegionState (`MATRIX_PRODUCT_LAYERS` emptied), and a subclass with a ``forward`` of its own still gets
    RegionState."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    from aiak.amp import compiled_region
    from aiak.amp.region_state import RegionState

    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16))

    def train(layers):
        monkeypatch.setattr(compiled_region, "MATRIX_PRODUCT_LAYERS", layers)
        model = copy.deepcopy(base)
        seen = []
        model.transformer.h[0].attn.c_attn.register_forward_pre_hook(lambda m, a: seen.append(m.weight))
        model, opt, _ = aiak.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      strategy={"precision": {"level": "O2", "dtype": "bf16"}})
        for _ in range(3):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return model, seen[0]

    fast, weight = train(compiled_region.MATRIX_PRODUCT_LAYERS)
    assert type(weight) is torch.Tensor and weight.dtype == torch.bfloat16
    shown, weight = train(frozenset())
    assert isinstance(weight, RegionState)
    for (name, a), b in zip(fast.state_dict().items(), shown.state_dict().values()):
        assert torch.equal(a, b), name
    monkeypatch.undo()

    class Scaled(Conv1D):
        def forward(self, x):
            return super().forward(x) * 2

    assert compiled_region.computes_as_torch_layer(Conv1D(4, 4))
    assert not compiled_region.computes_as_torch_layer(Scaled(4, 4))


def test_a_value_computed_from_the_models_own_parameter_under_inference_mode_meets_half_tensors():
    """A Swin-style relative position bias: ``self.table[self.index]`` (a parameter of the model's own class, indexed
    by a buffer) added to half attention scores. Under ``inference_mode`` the indexed value is an inference tensor,
    which has no version counter: O2 raised "Inference tensors do not track version counter" when it cast it to
    half (torchvision's and Hugging Face's Swin, BEiT, EfficientFormerV2 and wav2vec2 evaluated under
    ``inference_mode``). The evaluation equals the one under ``no_grad``."""

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.table = nn.Parameter(torch.randn(15))
            self.register_buffer("index", torch.randint(0, 15, (8,)))

        def forward(self, x):
            return self.lin(x) + self.table[self.index]

    torch.manual_seed(0)
    model, _, _ = aiak.optimize(Biased(), strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    model.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    with torch.inference_mode():
        out = model(x)
        again = model(x)
    assert torch.equal(out, expected) and torch.equal(again, expected)
