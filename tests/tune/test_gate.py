"""The numerics gate: fp32-equal gradients pass, bf16 on real models passes, broken candidates fail."""
import math

import pytest
import torch

from aiak.tune import gate


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 4, generator=g), "b.bias": torch.randn(3, generator=g)}


def test_identical_gradients_pass_with_cosine_one():
    ref = _grads()
    result = gate.compare({k: v.clone() for k, v in ref.items()}, ref)
    assert result.passed and math.isclose(result.cosine, 1.0, abs_tol=1e-12) and result.norm_diff < 1e-12


@pytest.mark.parametrize("broken", ["nan", "inf", "scaled", "sign", "unrelated", "one_tensor_zeroed"])
def test_broken_gradients_fail(broken):
    ref = _grads()
    cand = {k: v.clone() for k, v in ref.items()}
    if broken == "nan":
        cand["b.bias"][0] = float("nan")
    elif broken == "inf":
        cand["a.weight"][1, 1] = float("inf")
    elif broken == "scaled":          # an unscaled loss-scale factor left in: cosine 1 but the norm is off
        cand = {k: v * 1024 for k, v in cand.items()}
    elif broken == "sign":
        cand = {k: -v for k, v in cand.items()}
    elif broken == "unrelated":
        cand = _grads(seed=5)
    else:
        cand["a.weight"].zero_()
    result = gate.compare(cand, ref)
    assert not result.passed, result.why()


def test_bf16_rounding_passes():
    ref = _grads()
    cand = {k: v.bfloat16().float() for k, v in ref.items()}
    assert gate.compare(cand, ref).passed


def test_gradients_are_fp32_copies_and_missing_ones_are_zeros():
    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    m.bias.grad = None
    g = gate.gradients(m)
    assert torch.equal(g["weight"], m.weight.grad) and g["weight"] is not m.weight.grad
    assert torch.equal(g["bias"], torch.zeros(2))


def test_neutral_keys():
    assert gate.is_neutral(["channels_last", "loader.prefetch", "comm.bucket_mb"])
    assert not gate.is_neutral(["channels_last", "precision.level"])
    assert not gate.is_neutral(["compile"])


@pytest.mark.parametrize("size", [1e-25, 1e30])
def test_gradients_too_small_or_too_large_for_fp32_squares_are_judged_exactly(size):
    """fp32 squares of 1e-25 underflow to 0 and of 1e30 overflow to inf: such a gradient is neither lost nor
    infinite; the gate sums those tensors in float64."""
    ref = {k: v * size for k, v in _grads().items()}
    result = gate.compare({k: v.clone() for k, v in ref.items()}, ref)
    assert result.passed and not result.lost and math.isclose(result.cosine, 1.0, rel_tol=1e-9), result.why()
    halved = gate.compare({k: v / 2 for k, v in ref.items()}, ref)
    assert not halved.passed and math.isclose(halved.scale, 0.5, rel_tol=1e-6), halved.why()
