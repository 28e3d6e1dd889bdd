"""The user's unchanged clipping call is right under aiak: torch.nn.utils.clip_grad_norm_ / clip_grad_value_ on
an optimized model clip the true gradient of the real step (fp32 masters, unscaled, the whole accumulation
window), against a plain fp32 PyTorch loop that accumulates the same micro-batches and clips with the same call.
Every other call keeps torch's exact behaviour."""
import copy
import warnings

import pytest
import torch
from torch import nn

# Bound at import, before any aiak.optimize() ran: what a script doing `from torch.nn.utils import ...` holds.
from torch.nn.utils import clip_grad_norm_ as held_clip_grad_norm_
from torch.nn.utils import clip_grad_value_ as held_clip_grad_value_
from torch.nn.utils import get_total_norm as held_get_total_norm

import aiak

ACCUMULATION, MICRO, MAX_NORM, CLIP_VALUE = 4, 8, 0.05, 0.01
PRECISIONS = {
    "O2-fp16": {"precision": {"level": "O2", "dtype": "fp16"}},
    "O2-bf16": {"precision": {"level": "O2", "dtype": "bf16"}},
    "O0": {},
}
# ||w - w_ref|| / ||w_ref - w_start|| after the run: the half dtype's noise (measured: <= 0.016 fp16, <= 0.13
# bf16, 0 fp32). Without aiak's routing (HEAD before it) the same runs measured 1.0 (fp16: the loss-scaled
# gradients clipped, the real step ~65536x too small) and 0.6-0.87 (bf16, fp32: every micro-step's partial
# sum clipped).
TOLERANCE = {"O2-fp16": 0.06, "O2-bf16": 0.3, "O0": 1e-5}
NORM_RTOL = {"O2-fp16": 2e-2, "O2-bf16": 5e-2, "O0": 1e-5}


def _two_step(params, max_norm):
    """What Hugging Face's Trainer does for mixed device meshes: get_total_norm, then clip_grads_with_norm_."""
    params = list(params)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


CLIPS = {
    "norm: torch.nn.utils": lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM),
    "norm: torch.nn.utils.clip_grad": lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(ps, MAX_NORM),
    "norm: imported before optimize": lambda ps: held_clip_grad_norm_(ps, MAX_NORM),
    "norm: get_total_norm + clip_grads_with_norm_": lambda ps: _two_step(ps, MAX_NORM),
    "value: torch.nn.utils": lambda ps: torch.nn.utils.clip_grad_value_(ps, CLIP_VALUE),
    "value: imported before optimize": lambda ps: held_clip_grad_value_(ps, CLIP_VALUE),
}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def _windows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ACCUMULATION * MICRO, 12, generator=g), torch.randint(0, 3, (ACCUMULATION * MICRO,),
                                                                                 generator=g)) for _ in range(n)]


def test_the_held_functions_are_torchs_originals():
    assert held_clip_grad_norm_.__module__ == held_clip_grad_value_.__module__ == "torch.nn.utils.clip_grad"


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_plain_loop_clipping_equals_fp32_reference_with_accumulation(precision, clip):
    clip_fn = CLIPS[clip]
    ref = _model()
    start = [p.detach().clone() for p in ref.parameters()]
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is emulated (slow): not what this test is about
        model, opt, _ = aiak.optimize(model, opt, strategy={**PRECISIONS[precision], "grad_accumulation": ACCUMULATION})

    for x, y in _windows(4):
        # plain PyTorch: accumulate the averaged loss of the 4 micro-batches, clip once, step
        ref_partial = []  # the norm of the averaged gradient summed so far, after each micro-batch
        for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
            (nn.functional.cross_entropy(ref(xs), ys) / ACCUMULATION).backward()
            ref_partial.append(torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())
        ref_norm = clip_fn(ref.parameters())
        ref_opt.step()
        ref_opt.zero_grad()
        # the same loop as before aiak, unchanged: clip on every step() call
        norms = []
        for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
            nn.functional.cross_entropy(model(xs), ys).backward()
            norms.append(clip_fn(model.parameters()))
            opt.step()
            opt.zero_grad()
        if clip.startswith("norm"):
            assert ref_norm > MAX_NORM  # the clip really bites
            # micro-steps: nothing clipped, and the norm to log is the one accumulated so far, in true units
            for got, want in zip(norms[:-1], ref_partial[:-1]):
                torch.testing.assert_close(got.float(), want, rtol=NORM_RTOL[precision], atol=1e-7)
            torch.testing.assert_close(norms[-1].float(), ref_norm, rtol=NORM_RTOL[precision], atol=1e-7)

    moved = torch.cat([(r.detach() - s).flatten() for r, s in zip(ref.parameters(), start)]).norm()
    off = torch.cat([(m.detach().float() - r.detach()).flatten()
                     for m, r in zip(model.parameters(), ref.parameters())]).norm()
    assert moved > 0.04  # the reference really trained
    assert off <= TOLERANCE[precision] * moved, f"|w - w_ref| = {off:.3g}, |w_ref - w_start| = {moved:.3g}"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the fp32 parameters are what stepped


def test_unclipped_and_per_micro_step_clipping_would_be_caught():
    """The tolerance above separates the right result from the two wrong ones: no clipping, and clipping every
    micro-step's partial sum (what the plain loop does without aiak's routing)."""
    def run(clipping):  # "window": once per real step (right), "none", or "every micro-step"
        ref = _model()
        opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for x, y in _windows(4):
            for xs, ys in zip(x.split(MICRO), y.split(MICRO)):
                (nn.functional.cross_entropy(ref(xs), ys) / ACCUMULATION).backward()
                if clipping == "every micro-step":
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            if clipping == "window":
                torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().flatten() for p in ref.parameters()])

    start = torch.cat([p.detach().flatten() for p in _model().parameters()])
    right, unclipped, per_micro = run("window"), run("none"), run("every micro-step")
    moved = (right - start).norm()
    assert (unclipped - right).norm() > TOLERANCE["O2-bf16"] * moved
    assert (per_micro - right).norm() > TOLERANCE["O2-bf16"] * moved


def _plain_pair():
    a = _model()
    b = copy.deepcopy(a)
    x, y = _windows(1)[0]
    for m in (a, b):
        nn.functional.cross_entropy(m(x), y).backward()
    return a, b


def test_calls_on_other_parameters_behave_exactly_like_torch():
    aiak_model = _model()
    aiak_model, aiak_opt, _ = aiak.optimize(aiak_model, torch.optim.SGD(aiak_model.parameters(), lr=0.1),
                                            strategy={"grad_accumulation": 2})
    assert torch.nn.utils.clip_grad_norm_ is not held_clip_grad_norm_  # the patch is installed and routing
    for kwargs in ({}, {"norm_type": 1.0}, {"norm_type": float("inf")}, {"foreach": True}, {"foreach": False}):
        a, b = _plain_pair()
        got = torch.nn.utils.clip_grad_norm_(a.parameters(), MAX_NORM, **kwargs)
        want = held_clip_grad_norm_(b.parameters(), MAX_NORM, **kwargs)
        assert torch.equal(got, want), kwargs
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters())), kwargs
    a, b = _plain_pair()
    torch.nn.utils.clip_grad_value_(a.parameters(), CLIP_VALUE, foreach=True)
    held_clip_grad_value_(b.parameters(), CLIP_VALUE, foreach=True)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    a, b = _plain_pair()
    assert torch.equal(torch.nn.utils.get_total_norm([p.grad for p in a.parameters()]),
                       held_get_total_norm([p.grad for p in b.parameters()]))
    single = nn.Parameter(torch.ones(3))
    single.grad = torch.full((3,), 2.0)
    assert torch.equal(torch.nn.utils.clip_grad_norm_(single, 1.0), torch.tensor(12.0).sqrt())

    a, _ = _plain_pair()
    next(a.parameters()).grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(a.parameters(), MAX_NORM, error_if_nonfinite=True)
    with pytest.warns(UserWarning, match="empty generator"):
        torch.nn.utils.clip_grad_norm_((p for p in []), MAX_NORM)


def test_mixing_an_aiak_models_parameters_with_others_warns_and_runs_torchs_function(monkeypatch):
    from aiak.util import warn

    aiak_model = _model()
    opt = torch.optim.SGD(aiak_model.parameters(), lr=0.1)
    aiak_model, opt, _ = aiak.optimize(aiak_model, opt, strategy={"grad_accumulation": 2})
    other = _model()
    x, y = _windows(1)[0]
    for m in (aiak_model, other):
        nn.functional.cross_entropy(m(x), y).backward()
    expected = held_get_total_norm([p.grad.clone() for p in list(aiak_model.parameters()) + list(other.parameters())])
    monkeypatch.setattr(warn, "_warned", set())  # as in a fresh process
    with pytest.warns(UserWarning, match="cannot tell which real step"):
        norm = torch.nn.utils.clip_grad_norm_(list(aiak_model.parameters()) + list(other.parameters()), 1e9)
    assert torch.equal(norm, expected)


def test_get_total_norm_bound_before_optimize_warns_on_an_aiak_model(monkeypatch):
    from aiak.util import warn

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16"}})
    x, y = _windows(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    monkeypatch.setattr(warn, "_warned", set())
    with pytest.warns(UserWarning, match="bound before aiak.optimize"):
        held_get_total_norm([p.grad for p in model.parameters()])


def test_clipping_an_overflowed_fp16_step_returns_inf_and_the_step_is_skipped():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16"}})
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _windows(1)[0]
    (nn.functional.cross_entropy(model(x), y) * float("inf")).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=True)  # no raise:
    assert torch.isinf(norm)  # an overflow under loss scaling is routine, step() skips it
    opt.step()
    assert opt._aiak_steps.scaler.skipped_steps == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
