"""``optimizer.fused``: the script's own torch optimizer steps with torch's fused kernel (`aiak.optim.fused_step`).

Each test compares with the same optimizer that aiak never saw, stepping torch's loop. The fused kernel rounds
differently: weights agree to 1e-5 relative plus 1e-6 of each tensor's largest value after 6 steps (measured
differences are a few ulps); a property that only holds when the fused kernel really runs is checked by the profiler
(``aten::_fused_*`` ops in the step).
"""
import copy

import pytest
import timm
import timm.optim
import torch
from torch import nn

import aiak
from aiak.optim.fused_step import fused_step_refusal, use_fused_step

FUSED = {"optimizer": {"fused": True}}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 5))


def _batches(n=6):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _train(model, opt, batches, scheduler=None):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def _ops_of_one_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    return {e.key for e in prof.key_averages()}


OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "sgd-nesterov-decay": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "sgd-plain-maximize": (torch.optim.SGD, dict(lr=0.01, maximize=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam-amsgrad-decay": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_fused_step_trains_as_torchs_loop_does(name):
    """Six steps with a StepLR halving the learning rate: weights and every state tensor as the loop's, and the
    step runs torch's fused op (without ``optimizer.fused`` it does not)."""
    cls, kw = OPTIMIZERS[name]
    batches = _batches()
    plain_model = _model()
    plain = cls(plain_model.parameters(), **kw)
    model = _model()
    opt = cls(model.parameters(), **kw)
    model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
    _train(plain_model, plain, batches[:-1], torch.optim.lr_scheduler.StepLR(plain, 1, gamma=0.5))
    _train(model, opt, batches[:-1], torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    ops = _ops_of_one_step(model, opt, batches[-1])
    plain_ops = _ops_of_one_step(plain_model, plain, batches[-1])
    fused_op = f"aten::_fused_{'adamw' if cls is torch.optim.AdamW else cls.__name__.lower()}_"
    assert fused_op in ops and fused_op not in plain_ops
    _assert_close(list(model.parameters()), list(plain_model.parameters()))
    for p, q in zip(model.parameters(), plain_model.parameters()):
        for key, value in plain.state[q].items():
            torch.testing.assert_close(opt.state[p][key].float(), value.float(), rtol=1e-5,
                                       atol=1e-6 * value.float().abs().max().item())


def test_sgd_momentum_starts_the_buffers_of_a_layer_unfrozen_later():
    """Torch's fused SGD fails on a step where some parameters get their first gradient while others have
    momentum buffers; that step runs the loop, and training equals the loop's throughout (the head's gradient
    comes from step 3 on, as in a layer unfrozen later)."""
    batches = _batches()

    def run(fused):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if fused:
            model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
        head = model[3]
        head.requires_grad_(False)
        for i, (x, y) in enumerate(batches):
            head.requires_grad_(i >= 2)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model, opt

    want, _ = run(False)
    got, opt = run(True)
    _assert_close(list(got.parameters()), list(want.parameters()))
    assert all(g["fused"] is True for g in opt.param_groups)   # back on after that one step


def test_torchs_fused_sgd_alone_fails_on_that_step():
    """The failure the step hook avoids is torch's (if torch fixes it, this test says the hook can go)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    model[3].requires_grad_(False)
    for i, (x, y) in enumerate(_batches(3)):
        model[3].requires_grad_(i >= 2)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if i < 2:
            opt.step()
        else:
            with pytest.raises(TypeError, match="NoneType"):
                opt.step()


def test_a_checkpoint_says_what_the_script_set_and_a_loaded_one_keeps_the_fused_step():
    """``state_dict()`` holds the script's ``fused``/``foreach`` (a plain torch optimizer loads it as its own);
    ``load_state_dict`` into the optimized optimizer keeps the fused step on, and resuming equals not stopping."""
    batches = _batches()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
    assert all(g["fused"] is True and not g["foreach"] for g in opt.param_groups)
    _train(model, opt, batches[:3])
    saved = copy.deepcopy(opt.state_dict())
    assert [(g["fused"], g["foreach"]) for g in saved["param_groups"]] == [(None, True)]
    weights = copy.deepcopy(model.state_dict())
    _train(model, opt, batches[3:])
    straight = [p.detach().clone() for p in model.parameters()]

    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    assert all(g["fused"] is True and not g["foreach"] for g in opt.param_groups)
    _train(model, opt, batches[3:])
    for a, b in zip(model.parameters(), straight):
        assert torch.equal(a, b)

    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, foreach=True)
    plain.load_state_dict(saved)
    assert [(g["fused"], g["foreach"]) for g in plain.param_groups] == [(None, True)]


def test_groups_added_later_step_fused_and_save_the_optimizers_defaults():
    model = _model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
    opt.add_param_group({"params": list(model[3].parameters()), "lr": 0.01})
    assert opt.param_groups[1]["fused"] is True
    assert [g["fused"] for g in opt.state_dict()["param_groups"]] == [None, None]


def test_a_deep_copy_keeps_the_fused_step_but_not_the_hooks():
    """Torch copies an optimizer's defaults, state and groups only: a copy steps fused, and its checkpoints say so."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
    twin_model, twin = copy.deepcopy((model, opt))   # one memo: the copy's groups hold the copy's parameters
    _train(model, opt, _batches(2))
    _train(twin_model, twin, _batches(2))
    for a, b in zip(twin_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert twin.state_dict()["param_groups"][0]["fused"] is True
    assert opt.state_dict()["param_groups"][0]["fused"] is None


class _OwnStep(torch.optim.SGD):
    def step(self, closure=None):
        return super().step(closure)


class _Inherits(torch.optim.Adam):
    pass


@pytest.mark.parametrize("make,why", [
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3), "RMSprop has no fused step in torch"),
    (lambda ps: _OwnStep(ps, lr=0.1), "_OwnStep has a step of its own"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, differentiable=True), "differentiable=True"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=False), "the script set fused=False"),
], ids=["rmsprop", "subclass-with-its-own-step", "differentiable", "script-said-no"])
def test_an_optimizer_the_fused_step_cannot_serve_is_left_as_it_is(make, why):
    model = _model()
    opt = make(model.parameters())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    model, opt, _ = aiak.optimize(model, opt, None, strategy=FUSED)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert why in aiak.last_decision().effect("optimizer.fused")


def test_a_subclass_that_keeps_torchs_step_is_served():
    model = _model()
    opt = _Inherits(model.parameters(), lr=1e-3)
    assert fused_step_refusal(opt) is None
    assert use_fused_step(opt).startswith("on:")


def test_sparse_gradients_and_complex_parameters_keep_the_loop():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    assert "sparse gradients" in use_fused_step(opt, emb)
    assert opt.param_groups[0]["fused"] is None
    z = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    assert "complex64" in fused_step_refusal(torch.optim.Adam([z], lr=1e-3))


def test_lamb_keeps_its_own_step():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = aiak.optimize(model, opt, None, strategy={"optimizer": {"name": "lamb", "fused": True}})
    assert isinstance(opt, aiak.optim.Lamb)
    assert "Lamb steps in multi-tensor buckets of its own" in aiak.last_decision().effect("optimizer.fused")


def test_timms_optimizer_factory_gets_the_fused_step():
    model = timm.create_model("resnet10t", num_classes=4)
    for name in ("adamw", "sgd"):
        opt = timm.optim.create_optimizer_v2(model, name, lr=1e-3, weight_decay=0.05)
        assert fused_step_refusal(opt, model) is None, name


def test_auto_turns_it_on_and_explains_it():
    """The base of ``auto`` sets it; the decision record says why and what was done."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = [(torch.randn(4, 12), torch.randint(0, 5, (4,))) for _ in range(3)]
    model, opt, _ = aiak.optimize(model, opt, loader, strategy={"extends": "auto_base", "tune": False})
    assert opt.param_groups[0]["fused"] is True
    assert aiak.last_decision().effect("optimizer.fused").startswith("on: SGD(fused=True)")
