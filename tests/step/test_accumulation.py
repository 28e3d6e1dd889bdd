"""Gradient accumulation behind a plain ``optimizer.step()``: N micro-batches of B == one batch of N*B."""
import copy
import warnings

import pytest
import torch
from torch import nn

import aiak


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def _batches(n_steps, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n_steps)]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
}


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_accumulate_4_micro_batches_equals_one_big_batch(opt_name):
    n, micro = 4, 8
    big_model = _model()
    big_opt = OPTIMIZERS[opt_name](big_model.parameters())
    acc_model = copy.deepcopy(big_model)
    acc_opt = OPTIMIZERS[opt_name](acc_model.parameters())
    acc_model, acc_opt, _ = aiak.optimize(acc_model, acc_opt, strategy={"grad_accumulation": n})
    for x, y in _batches(5, n * micro):
        nn.functional.cross_entropy(big_model(x), y).backward()
        big_opt.step()
        big_opt.zero_grad()
        for xs, ys in zip(x.split(micro), y.split(micro)):
            nn.functional.cross_entropy(acc_model(xs), ys).backward()
            acc_opt.step()
            acc_opt.zero_grad()
    for a, b in zip(acc_model.parameters(), big_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the accumulation really did something: one micro-batch step differs
    assert acc_opt._aiak_steps.micro_step == 0


def test_micro_steps_do_not_touch_weights_and_zero_grad_keeps_the_sum():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"grad_accumulation": 3})
    before = copy.deepcopy(model.state_dict())
    (x1, y1), (x2, y2), (x3, y3) = _batches(3, 4)
    nn.functional.cross_entropy(model(x1), y1).backward()
    g1 = model[0].weight.grad.clone()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, g1)  # zero_grad inside the window kept the gradient
    nn.functional.cross_entropy(model(x2), y2).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    nn.functional.cross_entropy(model(x3), y3).backward()
    opt.step()
    assert not torch.equal(model[0].weight, before["0.weight"])
    assert model[0].weight.grad is None  # the real step clears gradients


def test_scheduler_advances_once_per_real_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _, sched = aiak.optimize(model, opt, strategy={"grad_accumulation": 4}, scheduler=sched)
    lrs = []
    for x, y in _batches(8, 4):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_scheduler_created_after_optimize_still_works():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _batches(1, 4)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_default_strategy_leaves_the_optimizer_unpatched():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = opt.step
    _, opt2, _ = aiak.optimize(model, opt, strategy="default")
    assert opt2 is opt and opt.step == step and not hasattr(opt, "_aiak_steps")




def test_optimizing_the_same_optimizer_twice_is_an_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    aiak.optimize(model, opt, strategy={"grad_accumulation": 2})
    with pytest.raises(RuntimeError, match="already passed through aiak.optimize"):
        aiak.optimize(model, opt, strategy={"grad_accumulation": 2})


def test_clip_grad_norm_clips_the_real_step_with_accumulation():
    """aiak.clip_grad_norm_ in the usual place (every step() call): no clipping on micro-steps (it returns the
    norm accumulated so far), true norm before the real step, same weights as clipping the big batch in plain
    PyTorch."""
    n, micro, max_norm = 4, 8, 0.05
    big_model = _model()
    big_opt = torch.optim.SGD(big_model.parameters(), lr=0.5)
    acc_model = copy.deepcopy(big_model)
    acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.5)
    acc_model, acc_opt, _ = aiak.optimize(acc_model, acc_opt, strategy={"grad_accumulation": n})
    for x, y in _batches(3, n * micro):
        nn.functional.cross_entropy(big_model(x), y).backward()
        big_norm = torch.nn.utils.clip_grad_norm_(big_model.parameters(), max_norm)
        big_opt.step()
        big_opt.zero_grad()
        norms, partial = [], []
        for xs, ys in zip(x.split(micro), y.split(micro)):
            nn.functional.cross_entropy(acc_model(xs), ys).backward()
            partial.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in acc_model.parameters()])) / n)
            norms.append(aiak.clip_grad_norm_(acc_opt, max_norm))
            if len(norms) < n:  # a micro-step clips nothing
                assert torch.equal(partial[-1], torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in acc_model.parameters()])) / n)
            acc_opt.step()
            acc_opt.zero_grad()
        # micro-steps report the (averaged) gradient summed so far: finite, what a logger can print
        torch.testing.assert_close(torch.stack(norms[:-1]), torch.stack(partial[:-1]), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(norms[-1], big_norm, rtol=1e-5, atol=1e-7)
        assert big_norm > max_norm  # the clip really bites
    for a, b in zip(acc_model.parameters(), big_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_sees_unscaled_gradients_under_fp16_loss_scaling():
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"precision": {"level": "O2", "dtype": "fp16"}})
    x, y = _batches(1, 16)[0]
    nn.functional.cross_entropy(ref(x), y).backward()
    true_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    nn.functional.cross_entropy(model(x), y).backward()
    norm = aiak.clip_grad_norm_(opt, 1e-3)
    assert opt._aiak_steps.scaler.scale == 2.0 ** 16          # the model's half gradients were scaled 65536x
    torch.testing.assert_close(norm, true_norm, rtol=2e-2, atol=1e-4)  # but the norm is the true one
    opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.isfinite(weights).all() and all(p.dtype == torch.float32 for p in model.parameters())


def test_stepped_tells_a_loop_that_counts_iterations_which_steps_were_real():
    """torchvision's EMA pattern counts loop iterations; under aiak's accumulation those are micro-steps (its EMA
    averaged 14 times for 7 real steps). ``aiak.stepped(optimizer)`` says which ``step()`` calls updated the
    weights: the EMA updated on those equals the EMA of plain big-batch training (1e-6), 7 updates; a step
    skipped for inf gradients is not one; an optimizer aiak did not patch always steps."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    big = _model()
    big_opt = torch.optim.SGD(big.parameters(), lr=0.1)
    big_ema = AveragedModel(big, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    model = copy.deepcopy(big)
    model, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  strategy={"grad_accumulation": 2})
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    flags = []
    for x, y in _batches(7, 16):
        nn.functional.cross_entropy(big(x), y).backward()
        big_opt.step()
        big_opt.zero_grad()
        assert aiak.stepped(big_opt)  # not aiak's: every step() is real
        big_ema.update_parameters(big)
        for xs, ys in zip(x.split(8), y.split(8)):
            nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
            opt.zero_grad()
            flags.append(aiak.stepped(opt))
            if flags[-1]:
                ema.update_parameters(model)
    assert flags == [False, True] * 7 and int(ema.n_averaged) == int(big_ema.n_averaged) == 7
    for a, b in zip(ema.parameters(), big_ema.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    scaled = _model()
    with warnings.catch_warnings():  # fp16 is emulated on a CPU (warned once per process): a tiny model
        warnings.simplefilter("ignore")
        scaled, scaled_opt, _ = aiak.optimize(scaled, torch.optim.SGD(scaled.parameters(), lr=0.1),
                                              strategy={"precision": {"level": "O1", "dtype": "fp16"}})
    x, y = _batches(1, 8, seed=1)[0]
    (nn.functional.cross_entropy(scaled(x), y) * float("inf")).backward()
    scaled_opt.step()
    assert scaled_opt._aiak_steps.scaler.skipped_steps == 1 and not aiak.stepped(scaled_opt)
    nn.functional.cross_entropy(scaled(x), y).backward()
    scaled_opt.step()
    assert aiak.stepped(scaled_opt)


def test_a_state_dict_taken_inside_a_window_says_what_to_do_and_says_it_again_as_it_recurs():
    """An epoch-based script (13 batches, accumulation 2) saving at each epoch's end: every other save falls inside
    a window. The warning names what to do (save when ``aiak.stepped``, or a multiple of grad_accumulation per
    epoch), and under Python's default filter, which shows a repeated message once, it is said again on the 2nd
    and 4th such save (rate-limited to powers of two: 3 warnings for 4 saves that lose micro-batches)."""
    model = _model()
    model, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  strategy={"grad_accumulation": 2})
    batches = _batches(13, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(7):
            for x, y in batches:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            opt.state_dict()
    said = [str(w.message) for w in caught if "accumulation window" in str(w.message)]
    assert len(said) == 3, said
    assert all("aiak.stepped(optimizer)" in m and "multiple of grad_accumulation (2)" in m for m in said)
    assert "2nd time" in said[1] and "4th time" in said[2]


def test_the_step_controller_is_freed_with_its_optimizer():
    """The hooks it leaves on the parameters hold it weakly: with the optimizer gone, the controller (and the DDP
    it may hold) is freed, not kept until interpreter shutdown, where gloo ranks aborted ("terminate called
    without an active exception")."""
    import gc
    import weakref

    model = _model()
    model, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  strategy={"grad_accumulation": 2})
    controller = weakref.ref(opt._aiak_steps)
    del opt
    gc.collect()
    assert controller() is None
