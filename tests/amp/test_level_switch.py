"""Switching a model's precision level between steps (`HalfCompute.switch_level`, what the run-time guard times):
exactly the compute a fresh O1 or O2 gives, and refused where the two levels' hooks differ."""
import copy

import pytest
import torch
from torch import nn

import aiak
from aiak.amp.half_compute import half_compute_of
from aiak.cli.demo import DemoNet

timm = pytest.importorskip("timm")


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.GELU(), nn.Linear(64, 10))


def _vit():
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, num_classes=10)


MODELS = {"demo": lambda: DemoNet(width=8), "mlp": _mlp, "vit": _vit}


def _at(model, level):
    aiak.optimize(model, strategy={"extends": "default", "precision": {"level": level, "dtype": "bf16"}})
    return half_compute_of(model)


def _loss_and_grads(model, x, y):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("start, to", [("O1", "O2"), ("O2", "O1")])
def test_a_switched_level_computes_as_a_fresh_one(name, start, to):
    """Bit-identical loss and gradients (tolerance 0) to the model optimized at the other level from the start, and
    the level really switched: O2 computes a Linear with a bf16 weight, O1 with the fp32 one (autocast casts it)."""
    torch.manual_seed(0)
    plain = MODELS[name]()
    switched, fresh = copy.deepcopy(plain), copy.deepcopy(plain)
    compute = _at(switched, start)
    _at(fresh, to)
    linear = next(m for m in switched.modules() if isinstance(m, nn.Linear))
    weights = []
    linear.register_forward_pre_hook(lambda m, args: weights.append(m.weight.dtype))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    assert compute.level_switchable(switched)
    _loss_and_grads(switched, x, y)            # a step at the first level first
    compute.switch_level(switched, to)
    loss, grads = _loss_and_grads(switched, x, y)
    want_loss, want = _loss_and_grads(fresh, x, y)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[n], want[n]) for n in want)
    half = {"O1": torch.float32, "O2": torch.bfloat16}
    assert weights == [half[start], half[to]]


def test_refused_where_o2_keeps_a_module_with_hooks_of_its_own():
    """A module kept in fp32 by ``precision.keep_fp32`` computes through O2's own hooks, which O1 lacks: the level
    cannot be switched exactly, and `switch_level` says so rather than computing something neither level is."""
    model = _mlp()
    aiak.optimize(model, strategy={"extends": "default", "precision": {"level": "O2", "dtype": "bf16",
                                                                       "keep_fp32": ["3"]}})
    compute = half_compute_of(model)
    assert not compute.level_switchable(model)
    with pytest.raises(ValueError, match="level_switchable"):
        compute.switch_level(model, "O1")
    assert compute.level == "O2"
