"""``optimize()`` is all or nothing: when it fails, the model, optimizer, scheduler, loader and the process-wide
switches are exactly as the caller passed them, and they train exactly like objects aiak never saw."""
import copy
import os

import pytest
import timm
import torch
from torch import nn
from torch.utils.data import DataLoader

import aiak
from aiak.amp.half_compute import half_compute_of
from aiak.cli.demo import DemoNet, synthetic_dataset
from aiak.runtime import malloc

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
              "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@pytest.fixture(autouse=True)
def _restore_process_switches():
    """A case that fails must not leave the next one bound to fewer cores (its check would then be vacuous)."""
    threads = torch.get_num_threads()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    torch.set_num_threads(threads)
    if cores is not None:
        os.sched_setaffinity(0, cores)


def _swin():
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
                             depths=(2, 2), num_heads=(2, 2), num_classes=4, drop_path_rate=0.0)


def _demo():
    torch.manual_seed(0)
    return DemoNet(width=8)


def _setup(make_model):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _fingerprint(model, opt, sched):
    """Everything a failed optimize() must leave as it was."""
    return {
        "state": {k: (v.dtype, v.stride(), v.clone()) for k, v in model.state_dict().items()},
        "classes": [(n, type(m)) for n, m in model.named_modules()],
        "hooks": [(n, d, len(getattr(m, d))) for n, m in model.named_modules() for d in HOOK_DICTS],
        "module_attrs": [(n, sorted(vars(m))) for n, m in model.named_modules()],
        "params": [id(p) for p in model.parameters()],
        "optimizer": (type(opt), sorted(vars(opt)), copy.deepcopy(opt.state_dict()),
                      [[id(p) for p in g["params"]] for g in opt.param_groups]),
        "optimizer_layouts": [(k, v.stride()) for state in opt.state.values() for k, v in state.items()
                              if isinstance(v, torch.Tensor)],
        "scheduler": (type(sched), sched.state_dict()) if sched is not None else None,
        "switches": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                     torch.backends.cudnn.benchmark, torch.get_num_threads(),
                     sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                     malloc.read()),
    }


def _assert_same(before, after):
    assert before["state"].keys() == after["state"].keys()
    for key, (dtype, stride, value) in before["state"].items():
        dtype2, stride2, value2 = after["state"][key]
        assert (dtype2, stride2) == (dtype, stride), key
        assert torch.equal(value2, value), key
    for name in ("classes", "hooks", "module_attrs", "params", "switches", "optimizer_layouts"):
        assert after[name] == before[name], name
    (cls, attrs, state, groups), (cls2, attrs2, state2, groups2) = before["optimizer"], after["optimizer"]
    assert (cls2, attrs2, groups2) == (cls, attrs, groups)
    assert repr(state2) == repr(state)
    assert after["scheduler"] == before["scheduler"]


def _train_steps(model, opt, sched, x, y, steps=2):
    torch.manual_seed(2)
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


CASES = {
    # fails at the very last step (loader wrapping), after surgery, O2 fp16, channels_last, accumulation,
    # the step controller and the scheduler patch were all applied
    "fails-at-the-loader": dict(
        make_model=_swin, loader=object(), input_shape=(2, 3, 56, 56),
        strategy={"fused_ops": ["window_attention"], "precision": {"level": "O2", "dtype": "fp16"},
                  "channels_last": True, "grad_accumulation": 2, "loader": {"prefetch": 2},
                  "cpu_affinity": True},
        error=(TypeError, "must be an iterable")),
    # the same with an optimizer resumed from its state (momentum buffers), which channels_last lays out NHWC
    "fails-at-the-loader-resumed": dict(
        make_model=_demo, loader=object(), input_shape=(2, 3, 16, 16), resumed=True,
        strategy={"channels_last": True, "loader": {"prefetch": 2}},
        error=(TypeError, "must be an iterable")),
    # the same after torch's fused step was turned on in the resumed optimizer's groups (and its hooks registered)
    "fails-at-the-loader-fused-step": dict(
        make_model=_demo, loader=object(), input_shape=(2, 3, 16, 16), resumed=True,
        strategy={"optimizer": {"fused": True}, "loader": {"prefetch": 2}},
        error=(TypeError, "must be an iterable")),
    # the same after fp8 swapped the classes of the Swin's eligible Linear layers (torchao, emulated here)
    "fails-at-the-loader-after-fp8": dict(
        make_model=_swin, loader=object(), input_shape=(2, 3, 56, 56),
        strategy={"precision": {"level": "O2", "dtype": "bf16", "fp8": "rowwise"}, "loader": {"prefetch": 2}},
        error=(TypeError, "must be an iterable")),
    # LAMB with no optimizer to take a learning rate from: fails at the optimizer swap, after CPU affinity, glibc
    # malloc's thresholds and surgery (the optimizer and scheduler are not given to aiak; they train the model afterwards)
    "fails-at-the-optimizer-swap": dict(
        make_model=_swin, no_optimizer=True, input_shape=(2, 3, 56, 56),
        strategy={"optimizer": {"name": "lamb"}, "cpu_affinity": True, "malloc_retain": True,
                  "fused_ops": ["window_attention"]},
        error=(ValueError, "optimizer.lr is required")),
    # surgery refuses a model that is already compiled: fails at step 3, after CPU affinity bound the process
    # to one core and set torch's thread count (as local rank 1 of 2)
    "fails-at-surgery": dict(
        make_model=lambda: torch.compile(_swin(), backend="eager"), input_shape=(2, 3, 56, 56),
        strategy={"fused_ops": ["window_attention"], "cpu_affinity": True, "precision": {"level": "O2"}},
        error=(TypeError, "already compiled")),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_failing_optimize_leaves_everything_as_it_was(case, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # cpu_affinity then binds this process to half the cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    malloc.write(False)   # as a process where no earlier test turned it on reads it (the thresholds stay fixed)
    spec = CASES[case]
    model, opt, sched = _setup(spec["make_model"])
    twin_model, twin_opt, twin_sched = _setup(spec["make_model"])  # built the same way, never given to aiak
    if spec.get("resumed"):   # one step taken before optimize(): the optimizer holds state
        g = torch.Generator().manual_seed(3)
        x = torch.randn(*spec["input_shape"], generator=g)
        y = torch.randint(0, 4, (spec["input_shape"][0],), generator=g)
        for m, o in ((model, opt), (twin_model, twin_opt)):
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
        assert opt.state
    before = _fingerprint(model, opt, sched)
    error, match = spec["error"]
    with pytest.raises(error, match=match):
        aiak.optimize(model, None if spec.get("no_optimizer") else opt, spec.get("loader"),
                      strategy=spec["strategy"], scheduler=None if spec.get("no_optimizer") else sched)
    _assert_same(before, _fingerprint(model, opt, sched))
    from aiak.amp.scaling import root_scaling
    assert not any(p in root_scaling._scalers for p in model.parameters())  # no backward of it will be scaled
    # and it trains exactly like objects aiak never touched (no hook, cast or step patch left behind)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*spec["input_shape"], generator=g)
    y = torch.randint(0, 4, (spec["input_shape"][0],), generator=g)
    got = _train_steps(model, opt, sched, x, y)
    want = _train_steps(twin_model, twin_opt, twin_sched, x, y)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_after_a_failure_the_same_objects_can_be_optimized():
    model, opt, sched = _setup(_demo)
    with pytest.raises(TypeError):
        aiak.optimize(model, opt, object(), strategy={"loader": {"prefetch": 2}, "precision": {"level": "O2"}})
    loader = DataLoader(synthetic_dataset(16, image_size=8), batch_size=8)
    model2, opt2, loader2 = aiak.optimize(model, opt, loader, strategy={"precision": {"level": "O2"}})
    assert model2 is model and opt2 is opt and half_compute_of(model) is not None


def test_validation_errors_come_before_any_change():
    model, opt, sched = _setup(_demo)
    before = _fingerprint(model, opt, sched)
    for strategy in ({"optimizer": {"name": "lamb", "lrr": 0.1}, "channels_last": True},
                     {"optimizer": {"name": "lamb", "lr": "abc"}, "cpu_affinity": True}):
        with pytest.raises(aiak.StrategyError, match="optimizer.lr"):
            aiak.optimize(model, opt, strategy=strategy, scheduler=sched)
        _assert_same(before, _fingerprint(model, opt, sched))
