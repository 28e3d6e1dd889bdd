"""The step controller under the calls frameworks make, with plain torch (issue 14, item 1).

Lightning always steps with ``optimizer.step(closure)``; Hugging Face's Trainer does ``loss *= ...`` on the
model's output and calls ``model.zero_grad()`` after each of its steps. Each test compares aiak under those
calls with plain PyTorch doing the same training with one big batch.
"""
import copy

import pytest
import torch
from torch import nn

import aiak


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


def _batches(n, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def _big_batch_reference(model, make_opt, batches, steps=3):
    """Plain torch: one step per big batch."""
    opt = make_opt(model.parameters())
    for x, y in batches[:steps]:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


SGD = lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)  # noqa: E731
ADAMW = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05)  # noqa: E731


@pytest.mark.parametrize("make_opt", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_step_with_a_closure_under_accumulation_equals_big_batch_training(make_opt):
    """Lightning's call: step(closure), the closure doing forward + backward. Returns the closure's loss on every
    call; the weights equal plain big-batch training to 1e-5 (fp32 summation order)."""
    reference = _big_batch_reference(_model(), make_opt, _batches(3, 16))
    model = _model()
    model, opt, _ = aiak.optimize(model, make_opt(model.parameters()), strategy={"grad_accumulation": 2})
    for x, y in _batches(3, 16):
        for xs, ys in zip(x.split(8), y.split(8)):
            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(xs), ys)
                loss.backward()
                return loss

            with torch.no_grad():  # Lightning may step outside grad mode; the closure must still build a graph
                returned = opt.step(closure)
            assert torch.is_tensor(returned) and returned.requires_grad
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*fp16.*:UserWarning")  # fp16 is emulated on a CPU
def test_step_with_a_closure_under_o2_and_loss_scaling_equals_the_loop_without_one():
    """O2 fp16 with dynamic loss scaling and accumulation 2: step(closure) gives bit-identical weights and the same
    loss scale as the plain ``backward(); step()`` loop."""
    def run(with_closure):
        model = _model()
        model, opt, _ = aiak.optimize(model, SGD(model.parameters()), strategy={
            "grad_accumulation": 2, "precision": {"level": "O2", "dtype": "fp16", "loss_scale": "dynamic"}})
        losses = []
        for x, y in _batches(4, 8):
            def closure():
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

            if with_closure:
                losses.append(float(opt.step(closure).detach()))
            else:
                losses.append(float(closure().detach()))
                opt.step()
            opt.zero_grad()
        return model, opt, losses

    plain_model, plain_opt, plain_losses = run(False)
    closure_model, closure_opt, closure_losses = run(True)
    assert closure_losses == plain_losses
    for a, b in zip(closure_model.state_dict().values(), plain_model.state_dict().values()):
        assert torch.equal(a, b)
    assert closure_opt._aiak_steps.scaler.scale == plain_opt._aiak_steps.scaler.scale
    assert closure_opt._aiak_steps.step_events == 2


class _LossModel(nn.Module):
    """Returns its own loss, as Hugging Face models do when given labels."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.filterwarnings("ignore:aiak. precision.dtype fp16 on CPU is emulated")
def test_in_place_ops_on_the_output_are_allowed_and_differentiate_right():
    """``loss *= w`` on the model's output (the Trainer's ``average_tokens_across_devices``) under fp16 loss scaling
    and accumulation: no error, and the gradient is that of the same op done out of place (1e-6), close to plain
    fp32 torch doing it (fp16's tolerance)."""
    strategy = {"grad_accumulation": 2, "precision": {"level": "O1", "dtype": "fp16", "loss_scale": 128.0}}
    torch.manual_seed(0)
    plain = _LossModel()
    (x, y), = _batches(1, 8)
    grads = []
    for in_place in (True, False):
        model = copy.deepcopy(plain)
        model, opt, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.0), strategy=strategy)
        loss = model(x, y)
        if in_place:
            loss *= 3.0
        else:
            loss = loss * 3.0
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    reference = plain(x, y)
    reference *= 3.0
    reference.backward()
    for a, b, c in zip(*grads, plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c.grad, rtol=2e-2, atol=2e-3)
    assert float(loss) == pytest.approx(float(reference), rel=1e-2)


@pytest.mark.parametrize("make_opt", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_model_zero_grad_inside_the_window_keeps_the_partial_sum(make_opt):
    """The Trainer's loop: ``optimizer.step(); model.zero_grad()`` every batch, aiak accumulating 2. Weights equal
    big-batch training to 1e-5 (they differed by 1e-1 when ``model.zero_grad()`` wiped the first micro-batch)."""
    reference = _big_batch_reference(_model(), make_opt, _batches(3, 16))
    model = _model()
    model, opt, _ = aiak.optimize(model, make_opt(model.parameters()), strategy={"grad_accumulation": 2})
    for x, y in _batches(3, 16):
        for xs, ys in zip(x.split(8), y.split(8)):
            nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
            model.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_model_zero_grad_under_o2_keeps_the_partial_sum():
    """Same with O2 bf16 (the sum lives on the half model parameters): equal to the loop with no zero_grad,
    bit for bit."""
    def run(wipe):
        model = _model()
        model, opt, _ = aiak.optimize(model, SGD(model.parameters()), strategy={
            "grad_accumulation": 2, "precision": {"level": "O2", "dtype": "bf16"}})
        for x, y in _batches(4, 8):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if wipe:
                model.zero_grad()
        return model

    wiped, kept = run(True), run(False)
    for a, b in zip(wiped.state_dict().values(), kept.state_dict().values()):
        assert torch.equal(a, b)


def test_zeroing_gradients_in_place_inside_the_window_is_an_error_not_a_silent_loss():
    model = _model()
    model, opt, _ = aiak.optimize(model, SGD(model.parameters()), strategy={"grad_accumulation": 2})
    (x, y), (x2, y2) = _batches(2, 8)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    model.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="modified in place inside a 2-step accumulation window"):
        nn.functional.cross_entropy(model(x2), y2).backward()


@pytest.mark.filterwarnings("ignore:aiak. precision.dtype fp16 on CPU is emulated")
@pytest.mark.parametrize("strategy", [{"grad_accumulation": 2},
                                      {"precision": {"level": "O1", "dtype": "fp16", "loss_scale": 128.0}},
                                      {"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 128.0},
                                       "grad_accumulation": 2}],
                         ids=["accumulation", "O1-loss-scale", "O2-loss-scale-accumulation"])
def test_a_loss_from_the_submodules_trains_like_one_from_the_model(strategy):
    """A LightningModule whose training_step calls ``self.net(x)``, or a loss from ``head(body(x))``: each submodule
    computes in half on its own and the loss scale is undone where gradients leave it, and the average over the
    window is taken at the real step, so the weights equal those of the loop that calls the model (1e-6). Once,
    such a step trained on 2x the gradient or 1/128 of it; then it was refused."""
    def run(through_model):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(12, 32), nn.Tanh()), nn.Linear(32, 3))
        model, opt, _ = aiak.optimize(model, SGD(model.parameters()), strategy=strategy)
        body, head = model
        for x, y in _batches(4, 8):
            out = model(x) if through_model else head(body(x))
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
        return model

    for a, b in zip(run(True).parameters(), run(False).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_penalty_beside_the_models_output_trains_as_plain_big_batch_training():
    """An L2 term on the parameters added to a loss from the model's output: its gradient reaches the fp32
    parameters directly, and the window's average at the real step gives plain big-batch training (1e-5)."""
    def penalty(m):
        return 1e-2 * sum((p ** 2).sum() for p in m.parameters())

    reference = _model()
    ref_opt = SGD(reference.parameters())
    model = copy.deepcopy(reference)
    model, opt, _ = aiak.optimize(model, SGD(model.parameters()), strategy={"grad_accumulation": 2})
    for x, y in _batches(3, 16):
        (nn.functional.cross_entropy(reference(x), y) + penalty(reference)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for xs, ys in zip(x.split(8), y.split(8)):
            (nn.functional.cross_entropy(model(xs), ys) + penalty(model)).backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
