"""Modules that O2 computes in fp32: named by ``precision.keep_fp32``, or found by a forward with no half kernel.

Each kept module must see fp32 inputs and its own fp32 weights inside an O2 forward, hand the half region its
output back, and train: the tests fail if the key did nothing (the module would see bf16) or if the fallback did
nothing (``torch.linalg.det`` in bf16 on a CPU raises "not implemented for 'BFloat16'"; autocast, which the region
runs under, leaves it to its input's dtype)."""
import copy
import warnings

import pytest
import torch
from torch import nn

import aiak

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.dtype")


class Probe(nn.Module):
    """Records the dtypes its forward sees."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        self.saw = (x.dtype, self.lin.weight.dtype)
        return self.lin(x)


class Determinants(nn.Module):
    """Six determinants of 2x2 blocks of a projection (a volume-preserving flow's log-determinant terms)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 24)

    def forward(self, x):
        return torch.linalg.det(self.proj(x).reshape(-1, 6, 2, 2))


def _model(middle):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), middle, nn.Linear(6, 3))


def _optimize(model, precision):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"precision": precision})
    return model, optimizer


@pytest.mark.parametrize("name", ["Probe", "1"])
def test_keep_fp32_by_class_or_path_computes_that_module_in_fp32_and_the_rest_in_half(name):
    model, optimizer = _optimize(_model(Probe()), {"level": "O2", "dtype": "bf16", "keep_fp32": [name]})
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
    out = model(torch.randn(4, 6))
    assert model[1].saw == (torch.float32, torch.float32)           # kept: fp32 in, fp32 weights
    assert seen == [(torch.bfloat16, torch.bfloat16)]               # the next layer: back in half
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model[1].lin.weight.grad is not None and model[0].weight.grad is not None
    optimizer.step()


def test_without_keep_fp32_the_module_computes_in_half():
    model, _ = _optimize(_model(Probe()), {"level": "O2", "dtype": "bf16"})
    model(torch.randn(4, 6))
    assert model[1].saw == (torch.bfloat16, torch.bfloat16)


def test_keep_fp32_names_that_match_no_module_are_all_reported_and_nothing_is_changed():
    model = _model(Probe())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(aiak.StrategyError) as error:
        _optimize(model, {"level": "O2", "dtype": "bf16", "keep_fp32": ["Prob", "encoder.fourier"]})
    text = str(error.value)
    assert "precision.keep_fp32: 'Prob'" in text and "did you mean 'Probe'" in text
    assert "'encoder.fourier'" in text and "Probe" in text
    assert not any("_call_impl" in vars(m) or m._forward_pre_hooks for m in model.modules())  # all or nothing
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_keep_fp32_under_o1_warns_that_it_does_not_apply(warnings_said_again, said):
    with said:
        _optimize(_model(Probe()), {"level": "O1", "dtype": "bf16", "keep_fp32": ["Probe"]})
    assert "precision.keep_fp32 applies to O2" in said.text


def test_a_module_with_no_half_kernel_is_kept_in_fp32_once_said_and_trains_like_fp32(warnings_said_again):
    reference = _model(Determinants())
    model, optimizer = _optimize(copy.deepcopy(reference), {"level": "O2", "dtype": "bf16"})
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the premise: no bf16 kernel, and autocast does not cast
        with pytest.raises(RuntimeError, match="not implemented for 'BFloat16'"):
            torch.linalg.det(torch.randn(2, 2, 2, dtype=torch.bfloat16))
    x = torch.randn(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
        model(x)
    said = [str(w.message) for w in caught if "Determinants" in str(w.message)]
    assert len(said) == 1 and "fp32" in said[0] and "precision.keep_fp32" in said[0]
    out.sum().backward()
    reference(x).sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        # the determinant block in fp32, the two Linear layers around it in bf16: 8 bits of mantissa, a few percent
        torch.testing.assert_close(p.grad, r.grad, rtol=0.05, atol=0.05)
    optimizer.step()


class GainNorm(nn.Module):
    """A norm layer of the user's (a leaf whose class name says Norm): O2 keeps it in fp32."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class NormedProbe(nn.Module):
    """A kept block holding a norm layer of its own before a Linear: inside it everything is fp32."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = GainNorm(6), nn.Linear(6, 6)

    def forward(self, x):
        h = self.norm(x)
        self.saw = (h.dtype, self.lin.weight.dtype)
        return self.lin(h)


def test_a_norm_layer_inside_a_kept_module_hands_it_fp32():
    """The fp32 hooks cast a kept module's output back to half only when its input came in half: the norm inside
    the kept block (fp32 in, from the block) returns fp32, so the block's Linear computes in fp32."""
    model, optimizer = _optimize(_model(NormedProbe()), {"level": "O2", "dtype": "bf16", "keep_fp32": ["NormedProbe"]})
    out = model(torch.randn(4, 6))
    assert model[1].saw == (torch.float32, torch.float32) and out.dtype == torch.float32
    out.sum().backward()
    optimizer.step()
