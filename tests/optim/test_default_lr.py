"""``aiak.optim.Lamb`` / ``Lars`` default ``lr`` like timm's, the peer they are tested against (issue 14, item 4)."""
import inspect

import pytest
import timm.optim
import torch

import aiak.optim
from aiak.optim import Lamb, Lars


@pytest.mark.parametrize("ours,theirs", [(Lamb, timm.optim.Lamb), (Lars, timm.optim.Lars)])
def test_default_lr_is_timms(ours, theirs):
    timm_default = inspect.signature(theirs).parameters["lr"].default
    opt = ours([torch.nn.Parameter(torch.ones(3))])
    assert opt.defaults["lr"] == timm_default and opt.param_groups[0]["lr"] == timm_default


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_create_without_lr_uses_the_default_and_steps(name):
    model = torch.nn.Linear(4, 2)
    opt = aiak.optim.create(name, model)
    assert opt.param_groups[0]["lr"] == inspect.signature(type(opt)).parameters["lr"].default
    before = model.weight.detach().clone()
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert not torch.equal(model.weight, before)
