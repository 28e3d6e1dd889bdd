"""What a script's own loop does around aiak's gradient accumulation.

* timm's adaptive gradient clipping (``adaptive_clip_grad``, and ``dispatch_clip_grad(..., mode="agc")`` as timm's
  train.py calls it) once clipped the partial sums of every micro-step: with accumulation it now clips the real
  step's gradient (the window's average), like torch's ``clip_grad_norm_``.
* A clip function aiak does not route (bound before ``optimize()``) that changes gradients inside a window is
  said once, with what to do.
* A script that accumulates gradients itself (several backward passes between ``step()`` calls) with aiak's
  ``grad_accumulation`` too once silently multiplied the two (6 real steps in 24 batches); the script's wins,
  said once.
"""
import warnings

import pytest
import torch
from torch import nn

import aiak

timm_utils = pytest.importorskip("timm.utils")

pytestmark = pytest.mark.usefixtures("warnings_said_again")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n, size=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g) * 5, torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def _agc_run(clip, accumulation, batches):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if accumulation:
        model, opt, batches = aiak.optimize(model, opt, batches, strategy={"grad_accumulation": accumulation})
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        clip(model.parameters())
        opt.step()
        opt.zero_grad()
    return list(model.parameters())


@pytest.mark.parametrize("how", ["adaptive_clip_grad", "dispatch_clip_grad"])
def test_timms_agc_under_accumulation_clips_the_real_steps_gradient(how):
    """AGC with a factor that clips (0.01) on every micro-step of a 2-step window, against plain PyTorch on the
    concatenated pairs of batches: equal to float rounding. Before, AGC clipped each half's partial sum."""
    clip = {"adaptive_clip_grad": lambda ps: timm_utils.adaptive_clip_grad(ps, 0.01),
            "dispatch_clip_grad": lambda ps: timm_utils.dispatch_clip_grad(ps, 0.01, mode="agc")}[how]
    batches = _batches(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # routed: nothing to warn about
        got = _agc_run(clip, 2, batches)
    pairs = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(batches[::2], batches[1::2])]
    want = _agc_run(clip, None, pairs)
    unclipped = _agc_run(lambda ps: None, None, pairs)
    assert any(not torch.allclose(p, q) for p, q in zip(want, unclipped))  # AGC really clipped
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_clip_function_bound_before_optimize_that_edits_gradients_mid_window_is_said_once():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": 2})

    def scale_grads(parameters):  # a library's clip function aiak does not know, reading .grad itself
        for p in parameters:
            p.grad.mul_(0.5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches(6):
            nn.functional.cross_entropy(model(x), y).backward()
            scale_grads(model.parameters())
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in caught if "inside a 2-step accumulation window" in str(w.message)]
    assert len(said) == 1 and "aiak.clip_grad_norm_" in said[0], [str(w.message) for w in caught]


def test_the_scripts_own_accumulation_with_aiaks_is_said_once_with_the_fix():
    """timm's --grad-accum-steps 2 (backward every batch, step every 2nd) with grad_accumulation: 2."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(8)):
            (nn.functional.cross_entropy(model(x), y) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    said = [str(w.message) for w in caught if "backward passes" in str(w.message)]
    assert len(said) == 1 and "grad_accumulation: 2 is off" in said[0] and "every 4 batches" in said[0], said
    assert opt._aiak_steps.step_events == 4  # the script's 4 steps in 8 batches, not 2: the two do not multiply


def test_one_backward_per_step_says_nothing():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, loader = aiak.optimize(model, opt, _batches(6), strategy={"grad_accumulation": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # routed: changes nothing mid-window
            opt.step()
            opt.zero_grad()
