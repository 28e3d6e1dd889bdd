"""aiak.ops.linear_cross_entropy: the loss of a linear head without its logits, against the unfused formula.

Tolerances (flash-attention's rule): in fp32 the chunked loss and every gradient are within 1e-5 (relative to
the largest) of plain PyTorch's; in bf16 and fp16 the chunked result's error against an fp64 reference is at most
twice plain PyTorch's own error in that dtype, plus one ulp of the dtype at the gradient's scale.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from aiak.ops.linear_cross_entropy import ChunkedLinearCrossEntropy, chunk_tokens_for, linear_cross_entropy


def _inputs(n, hidden, vocab, dtype, ignored_every=7, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    if ignored_every:
        t[::ignored_every] = -100
    return h, w, b, t


def _run(h, w, b, t, upstream=3.0, **kwargs):
    """Loss and the gradients of ``upstream * loss.sum()`` for each input."""
    for x in (h, w, b):
        if x is not None:
            x.grad = None
    loss = linear_cross_entropy(h, w, t, b, **kwargs)
    (loss.sum() * upstream).backward()
    return [loss.detach()] + [x.grad.clone() for x in (h, w, b) if x is not None]


def _fp64_copy(*tensors):
    return [None if x is None else x.detach().double().requires_grad_() for x in tensors]


OPTIONS = [{}, {"label_smoothing": 0.1}, {"softcap": 3.0}, {"logit_scale": 0.5, "softcap": 2.0},
           {"reduction": "sum"}, {"reduction": "none"}, {"num_items": 37}, {"ignore_index": 5}]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "mean")
@pytest.mark.parametrize("shape", [(203, 48, 1001), (64, 32, 7), (17, 16, 4099)])
def test_fp32_equals_plain_pytorch_with_every_option(options, shape):
    h, w, b, t = _inputs(*shape, torch.float32)
    t[t == -100] = options.get("ignore_index", -100)
    plain = _run(h, w, b, t, implementation="plain", **options)
    chunked = _run(h, w, b, t, implementation="chunked", chunk_tokens=50, **options)
    for name, p, c in zip(("loss", "hidden", "weight", "bias"), plain, chunked):
        assert c.dtype == p.dtype and c.shape == p.shape, name
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-5 * float(p.abs().max()), msg=name)


def test_the_plain_formula_is_f_cross_entropy_of_f_linear():
    # The reference the others are held to is the unfused head itself.
    h, w, b, t = _inputs(40, 16, 300, torch.float32)
    expected = F.cross_entropy(F.linear(h, w, b), t, label_smoothing=0.2)
    got = linear_cross_entropy(h, w, t, b, label_smoothing=0.2, implementation="plain")
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"softcap": 3.0}, {"reduction": "none"},
                                     {"num_items": 11}], ids=lambda o: ",".join(o) or "mean")
def test_half_precision_is_as_close_to_fp64_as_plain_pytorch_is(dtype, options):
    h, w, b, t = _inputs(150, 64, 2001, dtype)
    plain = _run(h, w, b, t, implementation="plain", **options)
    chunked = _run(h, w, b, t, implementation="chunked", chunk_tokens=10, **options)   # 15 slices
    reference = _run(*_fp64_copy(h, w, b), t, implementation="plain", **options)
    eps = torch.finfo(dtype).eps
    for name, p, c, r in zip(("loss", "hidden", "weight", "bias"), plain, chunked, reference):
        assert c.dtype == p.dtype, name                          # fp32 loss, gradients in the inputs' dtype
        plain_error = float((p.double() - r).abs().max())
        error = float((c.double() - r).abs().max())
        assert error <= 2 * plain_error + eps * float(r.abs().max()), (name, error, plain_error)


def test_fp16_gradients_too_small_for_fp16_at_scale_one_survive_a_loss_scale():
    # A loss scale multiplies the upstream gradient because fp16 cannot hold the unscaled one: per-token softmax
    # gradients of a 4k vocabulary over 512 tokens are ~5e-7, under fp16's smallest normal. Gradients made in
    # the forward pass at scale 1 would flush them to zero; in fp16 the chunked op recomputes in backward.
    h, w, b, t = _inputs(512, 32, 4096, torch.float16, ignored_every=0, bias=False)
    plain = _run(h, w, None, t, upstream=65536.0, implementation="plain")
    chunked = _run(h, w, None, t, upstream=65536.0, implementation="chunked", chunk_tokens=128)
    assert plain[2].abs().max() > 0 and (plain[2] != 0).float().mean() > 0.5
    assert (chunked[2] != 0).float().mean() >= (plain[2] != 0).float().mean() - 0.01
    torch.testing.assert_close(chunked[2].float(), plain[2].float(), rtol=2e-2, atol=2e-2 * float(plain[2].abs().max()))


def test_frozen_inputs_get_no_gradient_and_cost_none():
    h, w, b, t = _inputs(64, 16, 500, torch.float32)
    w.requires_grad_(False)
    b.requires_grad_(False)
    loss = linear_cross_entropy(h, w, t, b, implementation="chunked", chunk_tokens=16)
    loss.backward()
    assert w.grad is None and b.grad is None and h.grad is not None
    expected = torch.autograd.grad(linear_cross_entropy(h, w, t, b, implementation="plain"), h)[0]
    torch.testing.assert_close(h.grad, expected, rtol=1e-5, atol=1e-7)


def test_every_token_ignored_gives_what_plain_gives():
    h, w, b, t = _inputs(20, 8, 50, torch.float32)
    t.fill_(-100)
    assert math.isnan(float(linear_cross_entropy(h, w, t, b, implementation="plain")))
    assert math.isnan(float(linear_cross_entropy(h, w, t, b, implementation="chunked")))
    summed = linear_cross_entropy(h, w, t, b, reduction="sum", implementation="chunked")
    summed.backward()
    assert float(summed) == 0.0 and float(h.grad.abs().max()) == 0.0


def test_batched_hidden_states_and_targets_keep_their_shape():
    h, w, b, t = _inputs(2 * 9, 8, 100, torch.float32)
    h3, t3 = h.detach().reshape(2, 9, 8).requires_grad_(), t.reshape(2, 9)
    none = linear_cross_entropy(h3, w, t3, b, reduction="none")
    assert none.shape == (2, 9)
    torch.testing.assert_close(none.reshape(-1), linear_cross_entropy(h, w, t, b, reduction="none",
                                                                     implementation="plain").detach())


def test_torch_op_is_used_where_it_computes_the_same_and_refused_where_it_does_not():
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    h, w, b, t = _inputs(200, 32, 700, torch.float32)
    plain = _run(h, w, b, t, implementation="plain", reduction="sum")
    theirs = _run(h, w, b, t, implementation="torch", reduction="sum")
    for p, c in zip(plain, theirs):
        torch.testing.assert_close(c, p, rtol=1e-5, atol=1e-5 * float(p.abs().max()))
    with pytest.raises(ValueError, match="implementation='torch' cannot compute this: it has no logit scale or "
                                         "soft-capping; use 'chunked'"):
        linear_cross_entropy(h, w, t, b, softcap=3.0, implementation="torch")
    with pytest.raises(ValueError, match="with label smoothing it runs its unchunked reference"):
        linear_cross_entropy(h, w, t, b, label_smoothing=0.1, implementation="torch")
    hb, wb, bb, tb = _inputs(20, 8, 50, torch.bfloat16)
    with pytest.raises(ValueError, match="loss is returned in torch.bfloat16"):
        linear_cross_entropy(hb, wb, tb, bb, implementation="torch")


@pytest.mark.parametrize("call, message", [
    (lambda h, w, t: linear_cross_entropy(h, w, t, reduction="avg"), r"reduction='avg'; valid choices: \['mean'"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, implementation="liger"), r"implementation='liger'; valid "
                                                                            r"choices: \['auto', 'chunked'"),
    (lambda h, w, t: linear_cross_entropy(h, w.t(), t), r"do not make a linear head"),
    (lambda h, w, t: linear_cross_entropy(h, w, t[:-1]), r"target \(19,\) must have hidden's shape"),
    (lambda h, w, t: linear_cross_entropy(h, w, t.float()), r"class indices"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
])
def test_bad_arguments_get_one_clear_error(call, message):
    h, w, _, t = _inputs(20, 8, 50, torch.float32)
    with pytest.raises((ValueError, TypeError), match=message):
        call(h, w, t)


def test_slices_hold_a_fixed_budget_of_logits_and_the_op_never_keeps_them():
    assert chunk_tokens_for(50257) * 50257 * 4 <= 256 * 2 ** 20 < (chunk_tokens_for(50257) + 1) * 50257 * 4
    assert chunk_tokens_for(256000) == chunk_tokens_for(10 ** 9) == 512     # never fewer tokens than that
    assert chunk_tokens_for(10 ** 9, min_tokens=16) == 16
    # What autograd keeps for backward: the gradients made in the forward pass ([N, H] and [V, H]), never a
    # tensor of [N, V] logits.
    h, w, b, t = _inputs(300, 16, 2000, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        loss = linear_cross_entropy(h, w, t, b, implementation="chunked", chunk_tokens=64)
    assert isinstance(loss.grad_fn, ChunkedLinearCrossEntropy._backward_cls)
    assert (300, 2000) not in saved
    plain_saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: plain_saved.append(tuple(x.shape)) or x, lambda x: x):
        linear_cross_entropy(h, w, t, b, implementation="plain")
    assert (300, 2000) in plain_saved                              # the check can fail: plain keeps its logits


def test_a_second_backward_through_one_loss_is_refused_not_doubled():
    # The gradients are made in the forward pass and scaled in place by the first backward; a second one (a graph
    # kept with retain_graph=True) would hand out the scaled tensors again.
    h, w, b, t = _inputs(64, 16, 500, torch.float32)
    loss = linear_cross_entropy(h, w, t, b, implementation="chunked")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second backward through the same loss.*implementation='plain'"):
        loss.backward()
    again = linear_cross_entropy(h, w, t, b, implementation="plain")
    again.backward(retain_graph=True)
    again.backward()                                                      # the plain formula takes it


PEAK_WORK = '''
import sys
import torch
from aiak.measure.memory import PeakMemory
from aiak.ops.linear_cross_entropy import linear_cross_entropy

MIB = 2 ** 20
vocab, hidden, tokens, chunk = 65536, 16, 2048, 256            # a slice's fp32 logits: 64 MiB; the weight 4 MiB
g = torch.Generator().manual_seed(0)
h = torch.randn(tokens, hidden, generator=g).to(getattr(torch, sys.argv[1])).requires_grad_()
w = (torch.randn(vocab, hidden, generator=g) * 0.1).to(h.dtype).requires_grad_()
t = torch.randint(0, vocab, (tokens,), generator=g)
for _ in range(2):                                             # the second pass is measured
    with PeakMemory() as forward:
        loss = linear_cross_entropy(h, w, t, implementation="chunked", chunk_tokens=chunk, reduction=sys.argv[2])
    with PeakMemory() as backward:
        loss.sum().backward()
    del loss
    h.grad = w.grad = None
print(forward.bytes / MIB, backward.bytes / MIB)
'''


@pytest.mark.parametrize("dtype, reduction", [("float32", "mean"), ("bfloat16", "mean"), ("float32", "none")])
def test_one_slice_of_logits_is_alive_at_a_time(dtype, reduction):
    """Measured in a fresh process (``aiak.measure.memory``'s exact setting): the forward (gradients made there) and
    the backward (recomputed with reduction 'none') each add at most one slice's fp32 logits (64 MiB) and the
    slice's few half-size copies to the gradients' 4 MiB. Two slices alive at once (the last one's gradient kept
    while the next one's logits are made) read 128 MiB and more."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", PEAK_WORK, dtype, reduction], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    forward, backward = (float(x) for x in out.stdout.split())
    assert max(forward, backward) >= 60                        # the check can fail: a slice is really measured
    limit = 64 + 4 + 8 + (64 if dtype == "bfloat16" else 0)    # bf16: the slice's bf16 logits and gradient beside
    assert forward < limit and backward < limit, (forward, backward)
