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


def test_the_numbers_are_those_of_the_whole_gradients_in_float64():
    """Scale, cosine and error against the noise are those of the concatenated gradients taken in float64, with a
    tensor exactly zero on either side (skipped in the error's sum: |0 - g| = |g|), and the same whether the
    reference's norms are given (`squared_norms`, once for every candidate) or taken in `compare`."""
    g = torch.Generator().manual_seed(3)
    ref = {"a": torch.randn(64, 8, generator=g), "b": torch.randn(16, generator=g), "c": torch.zeros(5, 5),
           "d": torch.randn(7, generator=g)}
    cand = {"a": ref["a"] + 0.01 * torch.randn(64, 8, generator=g), "b": ref["b"] * 1.02,
            "c": torch.randn(5, 5, generator=g) * 1e-3, "d": torch.zeros(7)}
    flat = lambda d: torch.cat([d[k].double().reshape(-1) for k in sorted(d)])
    c, r = flat(cand), flat(ref)
    noise = 0.5
    for result in (gate.compare(cand, ref, noise), gate.compare(cand, ref, noise, gate.squared_norms(ref))):
        assert result.lost == "d"
        assert math.isclose(result.scale, float(c @ r / (r @ r)), rel_tol=1e-6)
        assert math.isclose(result.cosine, float(c @ r / (c.norm() * r.norm())), rel_tol=1e-6)
        assert math.isclose(result.error_to_noise, float((c - r).norm()) / noise, rel_tol=1e-6)
