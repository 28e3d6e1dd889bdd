"""aiak.ops.window_attention on the CPU path: values and gradients against a float64 reference."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiak.ops import window_attention
from aiak.ops.window_attention import reference_window_attention, torch_window_attention

REPO = Path(__file__).resolve().parents[2]


def _inputs(windows, heads, n, d, nw, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(windows, heads, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(heads, n, n, generator=gen, dtype=torch.float64)
    mask = None
    if nw:
        keep = (torch.rand(nw, n, n, generator=gen) > 0.3) | torch.eye(n, dtype=torch.bool)
        mask = torch.where(keep, 0.0, -100.0).to(torch.float64)
    return q, k, v, bias, mask


def _forward_backward(fn, q, k, v, bias, mask, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves, None if mask is None else mask.to(dtype))
    return [out] + list(torch.autograd.grad(out, leaves, grad.to(dtype)))


@pytest.mark.parametrize("n,d,nw", [(49, 32, 4), (49, 32, 0), (64, 64, 2), (144, 32, 1), (20, 24, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_path_matches_float64_reference_with_grads(n, d, nw, dtype):
    q, k, v, bias, mask = _inputs(8, 3, n, d, nw)
    grad = torch.randn(q.shape, dtype=torch.float64)
    ref = _forward_backward(reference_window_attention, q, k, v, bias, mask, grad, torch.float64)
    got = _forward_backward(lambda *a: window_attention(*a, backend="torch"), q, k, v, bias, mask, grad, dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for name, g, r in zip(["out", "dq", "dk", "dv", "dbias"], got, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.double(), r, atol=tol * max(1.0, r.abs().max().item()), rtol=0, msg=name)


def test_bias_gradient_is_summed_over_windows():
    # dbias must equal the sum of the per-window gradients: compare with one call per window.
    q, k, v, bias, mask = _inputs(6, 2, 16, 8, 3)
    bias = bias.requires_grad_()
    window_attention(q, k, v, bias, mask, backend="torch").pow(2).sum().backward()
    summed = torch.zeros_like(bias)
    for w in range(q.shape[0]):
        b = bias.detach().clone().requires_grad_()
        reference_window_attention(q[w:w + 1], k[w:w + 1], v[w:w + 1], b, mask[w % 3:w % 3 + 1]).pow(2).sum().backward()
        summed += b.grad
    torch.testing.assert_close(bias.grad, summed, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_the_eager_error(dtype):
    q, k, v, bias, mask = _inputs(16, 3, 49, 32, 4)
    ref = reference_window_attention(q, k, v, bias, mask)
    low = [t.to(dtype) for t in (q, k, v)]
    eager_err = (reference_window_attention(*low, bias.float(), mask.to(dtype)).double() - ref).abs().max()
    fused = window_attention(*low, bias.float(), mask.to(dtype))
    assert fused.dtype == dtype
    assert (fused.double() - ref).abs().max() <= 2 * eager_err + 1e-3


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, bias, mask = _inputs(4, 2, 16, 8, 2)
    default = window_attention(q, k, v, bias, mask)
    explicit = reference_window_attention(q, k, v, bias, mask, scale=8 ** -0.5)
    other = window_attention(q, k, v, bias, mask, scale=0.5)
    torch.testing.assert_close(default, explicit)
    assert not torch.allclose(default, other)


def test_strided_inputs_as_produced_by_a_qkv_projection():
    q, k, v, bias, mask = _inputs(8, 3, 49, 16, 4)
    qkv = torch.stack([q, k, v]).permute(1, 3, 0, 2, 4).contiguous()  # [W, N, 3, H, D] like x @ W_qkv
    sq, sk, sv = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not sq.is_contiguous()
    torch.testing.assert_close(window_attention(sq, sk, sv, bias, mask), reference_window_attention(q, k, v, bias, mask))


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="cuda"), "backend='cuda'; valid choices: \\('auto', 'triton', 'torch'\\)"),
    (dict(bias=torch.zeros(2, 16, 15)), "bias must have shape \\[H, N, N\\]"),
    (dict(mask=torch.zeros(3, 16, 16)), "multiple of the number of mask windows nW=3"),
    (dict(mask=torch.zeros(2, 16, 16, dtype=torch.bool)), "additive floating mask"),
])
def test_bad_input_names_the_argument(kwargs, match):
    q = torch.randn(4, 2, 16, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        window_attention(q, q, q, **kwargs)


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(4, 2, 16, 8)
    with pytest.raises(ValueError, match="backend='triton' cannot run: inputs are not on a CUDA device"):
        window_attention(q, q, q, backend="triton")


def test_auto_on_cpu_runs_torch_and_never_imports_triton():
    code = ("import sys, torch, aiak\n"
            "q = torch.randn(4, 2, 16, 8)\n"
            "out = aiak.ops.window_attention(q, q, q, torch.zeros(2, 16, 16), torch.zeros(2, 16, 16))\n"
            "assert out.shape == q.shape\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'nvidia')))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_torch_path_is_a_single_sdpa_call(monkeypatch):
    # The CPU path must not materialise [B*nW, H, N, N] scores in eager ops: exactly one SDPA call whose
    # additive mask is the small [1, nW*H, N, N] bias+mask (broadcast over the batch).
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((tuple(q.shape), tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v, bias, mask = _inputs(32, 3, 49, 32, 8)
    torch_window_attention(q, k, v, bias, mask)
    assert calls == [((4, 24, 49, 32), (1, 24, 49, 49))]


@pytest.mark.parametrize("bias_grad", [True, False])
def test_torch_path_takes_sdpa_output_in_any_layout(monkeypatch, bias_grad):
    # CUDA's memory-efficient SDPA kernel returns its output as a [B, N, H, D] buffer seen as [B, H, N, D]
    # (unit stride on D, not contiguous); the CPU kernels return it contiguous. The same values in that
    # layout must come out of the torch path unchanged, forward and backward.
    real = torch.nn.functional.scaled_dot_product_attention

    def token_major_sdpa(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    q, k, v, bias, mask = _inputs(8, 3, 49, 32, 4)
    grad = torch.randn(q.shape, dtype=torch.float64)
    want = _forward_backward(reference_window_attention, q, k, v, bias, mask, grad, torch.float64)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", token_major_sdpa)
    leaves = [t.clone().requires_grad_(i < 3 or bias_grad) for i, t in enumerate((q, k, v, bias))]
    out = torch_window_attention(*leaves, mask)
    got = [out] + list(torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad))
    for name, g, w in zip(["out", "dq", "dk", "dv", "dbias"], got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0, msg=name)


def test_frozen_bias_uses_sdpa_backward_and_still_matches():
    q, k, v, bias, mask = _inputs(8, 3, 49, 32, 4)
    grad = torch.randn(q.shape, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = window_attention(*leaves, bias, mask, backend="torch")
    assert "SDPAWithBiasGrad" not in type(out.grad_fn).__name__
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference_window_attention(*ref_leaves, bias, mask), ref_leaves, grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_auto_on_cpu_trains_small_window_batches_with_eager_and_large_ones_with_sdpa():
    from aiak.ops.window_attention import CPU_TRAINING_SDPA_MIN_WINDOW_HEADS as limit

    def grad_fn_name(windows, heads):
        q = torch.randn(windows, heads, 4, 8, requires_grad=True)
        bias = torch.zeros(heads, 4, 4, requires_grad=True)
        return type(window_attention(q, q, q, bias).grad_fn).__name__

    assert "SDPAWithBiasGrad" in grad_fn_name(limit // 2 + 1, 2)   # large: the recomputing SDPA path
    assert "SDPAWithBiasGrad" not in grad_fn_name(limit // 4, 2)   # small: the eager formula
    with torch.no_grad():  # inference always takes SDPA
        q = torch.randn(4, 2, 4, 8)
        torch.testing.assert_close(window_attention(q, q, q), reference_window_attention(q, q, q))
