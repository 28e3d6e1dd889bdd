"""Shared pieces of the LAMB and LARS tests."""
import pytest
import torch


def _rounded_fp32_reference(optimizer_cls, params64, grads, adapt_mask, kw, dtype, steps, **opt_kw):
    """An fp32 optimizer over fp32 weights rounded to ``dtype`` after every step: what a half-parameter
    optimizer with fp32 math must reproduce exactly. Returns the fp32 parameters."""
    fp32 = [torch.nn.Parameter(p.to(dtype).float()) for p in params64]
    groups = [{"params": [p for p, a in zip(fp32, adapt_mask) if a], "weight_decay": kw["weight_decay"]},
              {"params": [p for p, a in zip(fp32, adapt_mask) if not a], "weight_decay": 0.0, "adapt": False}]
    ref = optimizer_cls(groups, **{k: v for k, v in kw.items() if k != "weight_decay"}, **opt_kw)
    for step_grads in grads[:steps]:
        for p, g in zip(fp32, step_grads):
            p.grad = g.to(dtype).float()
        ref.step()
        with torch.no_grad():
            for p in fp32:
                p.copy_(p.to(dtype).float())
    return fp32


@pytest.fixture
def rounded_fp32_reference():
    return _rounded_fp32_reference


def _assert_matches_reference(got, expected, initial, zero_param):
    """1e-5 relative, elementwise, with the absolute floor at 1e-5 of each tensor's scale; and the reference
    moved the zero-norm parameter too, so a no-op optimizer fails here."""
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g.detach().double(), e, rtol=1e-5, atol=1e-5 * float(e.abs().max()),
                                   msg=f"parameter {i}")
    assert not torch.equal(got[zero_param].detach().double(), initial[zero_param])


@pytest.fixture
def assert_matches_reference():
    return _assert_matches_reference
