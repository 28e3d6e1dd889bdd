"""int8 min-max codec and error feedback (single process)."""
import pytest
import torch

from aiak.comm.compression import (ErrorFeedback, check_compression, dequantize_int8, int8_packed_bytes,
                                   pad_to_multiple, quantize_int8)


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


def test_error_feedback_keeps_the_accumulated_error_bounded():
    """Sent sums track true sums within one quantization step with feedback; without it the bias accumulates."""
    torch.manual_seed(0)
    g = torch.randn(2048) * 1e-3
    g[0] = 1.0  # one large value sets the block's range: the small ones are far below one step
    sums = {}
    for enabled in (True, False):
        fb, sent = ErrorFeedback(enabled), torch.zeros_like(g)
        for _ in range(200):
            x = fb.add(0, g)
            decoded = dequantize_int8(quantize_int8(x, 2048), 2048, 2048)
            fb.update(0, x, decoded)
            sent += decoded
        sums[enabled] = (sent - 200 * g).abs().max().item()
    step = float(g.max() - g.min()) / 255
    assert sums[True] <= step
    assert sums[False] > 20 * step


def test_error_feedback_drops_residuals_of_another_shape():
    fb = ErrorFeedback()
    fb.update("b", torch.ones(4), torch.zeros(4))
    assert torch.equal(fb.add("b", torch.zeros(4)), torch.ones(4))
    assert torch.equal(fb.add("b", torch.zeros(6)), torch.zeros(6))


def test_pad_to_multiple():
    x = torch.arange(5.0)
    padded, n = pad_to_multiple(x, 4)
    assert n == 5 and padded.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    same, _ = pad_to_multiple(torch.arange(8.0), 4)
    assert same.numel() == 8


def test_bad_compression_names_the_choices():
    with pytest.raises(ValueError, match=r"comm.compression must be one of \['none', 'fp16', 'bf16', 'int8'\]"):
        check_compression("int4", "comm.compression")
