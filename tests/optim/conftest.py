"""Shared pieces of the LAMB and LARS tests."""
import copy

import pytest
import torch


def layerwise_groups(params, adapt_mask, weight_decay=0.0):
    """Adapted parameters with ``weight_decay``; the others in a group without decay or adaptation."""
    groups = [{"params": [p for p, a in zip(params, adapt_mask) if a], "weight_decay": weight_decay},
              {"params": [p for p, a in zip(params, adapt_mask) if not a], "weight_decay": 0.0, "adapt": False}]
    return [g for g in groups if g["params"]]


def step_through(opt, params, grads, dtype):
    """One ``opt.step()`` per entry of ``grads`` (a list of per-parameter gradients), cast to ``dtype``."""
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()


def _assert_resume_equals_uninterrupted(run, optimizer_cls, params64, grads, adapt_mask, dtype, state_key, **kw):
    """``run(params64, grads, adapt_mask, dtype, steps=..., **kw)`` trains ``optimizer_cls`` on all ``grads``.
    Stop after 10 steps, save, rebuild the optimizer with other hyper-parameters, load and finish: the
    weights equal an uninterrupted run bit for bit, and half parameters get their fp32 state back."""
    straight, _ = run(params64, grads, adapt_mask, dtype, **kw)
    first, opt = run(params64, grads, adapt_mask, dtype, steps=10, **kw)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    groups = layerwise_groups(resumed_params, adapt_mask, kw.get("weight_decay", 0.0))
    resumed = optimizer_cls(groups, lr=1.0, bucket_elems=kw.get("bucket_elems"))  # the rest from the state_dict
    resumed.load_state_dict(saved)
    assert all(s[state_key].dtype == torch.float32 for s in resumed.state.values())
    step_through(resumed, resumed_params, grads[10:], dtype)
    for a, b in zip(straight, resumed_params):
        assert torch.equal(a, b)


@pytest.fixture
def assert_resume_equals_uninterrupted():
    return _assert_resume_equals_uninterrupted


def _rounded_fp32_reference(optimizer_cls, params64, grads, adapt_mask, kw, dtype, steps, **opt_kw):
    """An fp32 optimizer over fp32 weights rounded to ``dtype`` after every step: what a half-parameter
    optimizer with fp32 math must reproduce exactly. Returns the fp32 parameters."""
    fp32 = [torch.nn.Parameter(p.to(dtype).float()) for p in params64]
    hyper = {k: v for k, v in kw.items() if k != "weight_decay"}
    ref = optimizer_cls(layerwise_groups(fp32, adapt_mask, kw["weight_decay"]), **hyper, **opt_kw)
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
