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
