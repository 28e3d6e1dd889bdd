"""Switching a model's channels_last layout between steps (`ChannelsLast.switch`, what the run-time guard times):
off, the model computes exactly as plain PyTorch's contiguous one, whatever layout its inputs arrive in; on again,
exactly as a model given channels_last from the start; the optimizer keeps training the same tensors."""
import copy

import pytest
import torch
from torch import nn

import aiak
from aiak.cli.demo import DemoNet
from aiak.runtime.switches import channels_last_of

timm = pytest.importorskip("timm")

MODELS = {"demo": lambda: DemoNet(width=8),
          "mobilenet": lambda: timm.create_model("mobilenetv3_small_050", num_classes=10)}


def _loss_and_grads(model, x, y):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_b)


def _nhwc(t):
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_off_is_plain_pytorch_and_on_again_is_channels_last(name):
    """Tolerance 0 both ways, with inputs in channels_last (as aiak's prefetcher delivers them) while the layout is
    off; and the layouts really differ here (else the test would prove nothing)."""
    torch.manual_seed(0)
    plain = MODELS[name]()
    switched, fresh = copy.deepcopy(plain), copy.deepcopy(plain)
    for m in (switched, fresh):
        aiak.optimize(m, strategy={"extends": "default", "channels_last": True})
    layout = channels_last_of(switched)
    x, y = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (4,))
    on = _loss_and_grads(switched, x, y)
    assert _same(on, _loss_and_grads(fresh, x, y))
    layout.switch(switched, False)
    assert not any(_nhwc(p) for p in switched.parameters())
    off = _loss_and_grads(switched, x, y)
    assert _same(off, _loss_and_grads(plain, x.contiguous(), y))
    assert not _same(off, on)
    layout.switch(switched, True)
    assert any(_nhwc(p) for p in switched.parameters())
    assert _same(_loss_and_grads(switched, x, y), on)


def test_the_optimizer_trains_the_same_tensors_across_a_switch():
    """SGD with momentum through on, off, on: every parameter is the tensor the optimizer holds, and the weights
    after three steps equal plain PyTorch's within fp32 rounding (1e-5: the layouts' kernels sum in another
    order)."""
    torch.manual_seed(0)
    model = DemoNet(width=8)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"extends": "default", "channels_last": True})
    layout = channels_last_of(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for on in (True, False, True):
        layout.switch(model, on)
        for m, opt in ((model, optimizer), (plain, reference)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    assert [p for group in optimizer.param_groups for p in group["params"]] == params
    assert all(a is b for a, b in zip(model.parameters(), params))
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _state_tensors(optimizer):
    """(parameter, state key, tensor) for every 4-D state tensor of a 4-D parameter."""
    return [(p, k, t) for p, state in optimizer.state.items() if p.dim() == 4
            for k, t in state.items() if isinstance(t, torch.Tensor) and t.shape == p.shape]


@pytest.mark.parametrize("make_optimizer", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                            lambda ps: torch.optim.AdamW(ps, lr=1e-3)], ids=["sgd", "adamw"])
def test_the_optimizers_state_follows_the_parameters_layout(make_optimizer):
    """Momentum and Adam's moments are laid out as their parameters at every switch, in place (the same tensor
    objects), their values unchanged: an update over two layouts is much slower, so plain compute's steps would not
    be plain PyTorch's (`aiak.runtime.switches.lay_out_state`)."""
    torch.manual_seed(0)
    model = DemoNet(width=8)
    optimizer = make_optimizer(model.parameters())
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"extends": "default", "channels_last": True})
    layout = channels_last_of(model)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    state = _state_tensors(optimizer)
    assert state and all(_nhwc(t) for _, _, t in state)
    for on in (False, True):
        values = [t.clone() for _, _, t in state]
        layout.switch(model, on, optimizer)
        now = _state_tensors(optimizer)
        assert all(a is b for (_, _, a), (_, _, b) in zip(now, state)) and len(now) == len(state)
        assert all(_nhwc(t) == on and _nhwc(p) == on for p, _, t in now if p.shape[-1] > 1)
        assert all(torch.equal(t, v) for (_, _, t), v in zip(now, values))


def test_a_resumed_optimizer_and_a_checkpoint_loaded_later_are_laid_out_like_the_model():
    """An optimizer given to `optimize()` with state (a resumed run) and a checkpoint loaded into it afterwards: its
    momentum buffers are NHWC like the parameters, their values the checkpoint's, and the next step gives plain
    PyTorch's weights within fp32 rounding (1e-5)."""
    torch.manual_seed(0)
    model = DemoNet(width=8)
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for m, opt in ((model, optimizer), (plain, reference)):
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()
    checkpoint = copy.deepcopy(reference.state_dict())
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"extends": "default", "channels_last": True})
    assert all(_nhwc(t) for p, _, t in _state_tensors(optimizer) if p.shape[-1] > 1)
    optimizer.load_state_dict(checkpoint)
    state = _state_tensors(optimizer)
    assert all(_nhwc(t) for p, _, t in state if p.shape[-1] > 1)
    assert all(torch.equal(t, reference.state[q][k]) for (p, k, t), q in zip(state, [
        q for q in plain.parameters() if q.dim() == 4]))
    for m, opt in ((model, optimizer), (plain, reference)):
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
