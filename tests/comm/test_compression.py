"""int8 min-max codec and error feedback (single process)."""
import pytest
import torch

from aiak.comm.allreduce.compression import (ErrorFeedback, FiniteFlag, check_compression, dequantize_int8,
                                             int8_packed_bytes, pad_to_multiple, quantize_int8)


@pytest.mark.parametrize("block", [1, 64, 2048])
def test_int8_roundtrip_error_is_half_a_step_per_block(block):
    torch.manual_seed(0)
    x = torch.randn(4 * block) * torch.logspace(0, 3, 4 * block)  # blocks of very different ranges
    packed = quantize_int8(x, block)
    assert packed.dtype == torch.uint8 and packed.numel() == int8_packed_bytes(x.numel(), block)
    y = dequantize_int8(packed, x.numel(), block)
    rows = x.view(-1, block)
    step = (rows.amax(1) - rows.amin(1)) / 255
    err = (y - x).abs().view(-1, block).amax(1)
    assert torch.all(err <= step / 2 * 1.001 + 1e-6)


def test_int8_is_exact_on_constant_blocks_and_bytes_are_a_quarter():
    x = torch.full((4096,), 3.25)
    assert torch.equal(dequantize_int8(quantize_int8(x, 2048), 4096, 2048), x)
    assert int8_packed_bytes(4096, 2048) < 0.26 * 4 * 4096


def _feedback_round(fb, key, g, block=2048):
    """What one int8 allreduce does with the feedback (one rank): compress ``g + r``, keep the error, commit."""
    x = fb.add(key, g)
    decoded = dequantize_int8(quantize_int8(x, block), x.numel(), block)
    fb.update(key, x, decoded)
    fb.commit([key], FiniteFlag(decoded))
    return decoded


def test_error_feedback_keeps_the_accumulated_error_bounded():
    """Sent sums track true sums within one quantization step with feedback; without it the bias accumulates."""
    torch.manual_seed(0)
    g = torch.randn(2048) * 1e-3
    g[0] = 1.0  # one large value sets the block's range: the small ones are far below one step
    sums = {}
    for enabled in (True, False):
        fb, sent = ErrorFeedback(enabled), torch.zeros_like(g)
        for _ in range(200):
            sent += _feedback_round(fb, 0, g)
        sums[enabled] = (sent - 200 * g).abs().max().item()
    step = float(g.max() - g.min()) / 255
    assert sums[True] <= step
    assert sums[False] > 20 * step


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_round_leaves_the_residual_as_it_was(poison):
    """The residual after a round whose result is inf/NaN is bit-identical to the one before it, and later rounds
    send exactly what a twin that never saw the bad round sends."""
    torch.manual_seed(0)
    grads = [torch.randn(4096) * 1e-2 for _ in range(6)]
    bad = grads[3].clone()
    bad[5] = poison
    hit, twin = ErrorFeedback(), ErrorFeedback()
    for g in grads[:3]:
        _feedback_round(hit, "k", g)
        _feedback_round(twin, "k", g)
    before = hit.residuals()
    assert set(before) == {"k"} and torch.isfinite(before["k"]).all()
    assert not torch.isfinite(_feedback_round(hit, "k", bad)).all()  # the bad round's result is non-finite
    assert torch.equal(hit.residuals()["k"], before["k"])
    for g in grads[3:]:
        assert torch.equal(_feedback_round(hit, "k", g), _feedback_round(twin, "k", g))


def test_a_residual_without_a_finite_commit_is_not_used():
    """An allreduce that failed before :meth:`commit` (or was not finite) must not leave its candidate behind."""
    fb = ErrorFeedback()
    x = fb.add("k", torch.zeros(4))
    fb.update("k", x, torch.full((4,), -1.0))  # candidate residual: ones
    assert torch.equal(fb.add("k", torch.zeros(4)), torch.zeros(4))  # no commit: dropped
    fb.update("k", fb.add("k", torch.zeros(4)), torch.full((4,), -1.0))
    fb.commit(["k"], FiniteFlag(torch.ones(4)))
    assert torch.equal(fb.add("k", torch.zeros(4)), torch.ones(4))


def test_error_feedback_drops_residuals_of_another_shape():
    fb = ErrorFeedback()
    x = fb.add("b", torch.zeros(4))
    fb.update("b", x, torch.full((4,), -1.0))
    fb.commit(["b"], FiniteFlag(torch.zeros(4)))
    assert torch.equal(fb.add("b", torch.zeros(4)), torch.ones(4))
    assert torch.equal(fb.add("b", torch.zeros(6)), torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_flag_sees_nan_and_both_infinities(dtype):
    x = torch.randn(5000).to(dtype)
    assert bool(FiniteFlag(x))
    assert bool(FiniteFlag(torch.full((7,), torch.finfo(dtype).max, dtype=dtype)))
    for poison in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1234] = poison
        assert not bool(FiniteFlag(y)), poison


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_makes_its_whole_block_decode_non_finite(poison):
    """So every rank that decodes the bytes sees the bucket as non-finite (and every rank skips the step)."""
    x = torch.randn(3 * 64)
    x[64 + 7] = poison
    y = dequantize_int8(quantize_int8(x, 64), x.numel(), 64)
    assert not torch.isfinite(y[64:128]).any()
    assert torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all()


def test_pad_to_multiple():
    x = torch.arange(5.0)
    padded, n = pad_to_multiple(x, 4)
    assert n == 5 and padded.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    same, _ = pad_to_multiple(torch.arange(8.0), 4)
    assert same.numel() == 8


def test_bad_compression_names_the_choices():
    with pytest.raises(ValueError, match=r"comm.compression must be one of \['none', 'fp16', 'bf16', 'int8'\]"):
        check_compression("int4", "comm.compression")
