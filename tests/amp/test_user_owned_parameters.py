"""Under O1/O2 the model's parameters stay the user's fp32 tensors, so what users do with them keeps working.

Each test runs a plain-PyTorch idiom on a model passed through ``aiak.optimize`` and checks it against what the
same idiom does (or what plain fp32 arithmetic gives) without aiak:

* EMA copies: timm's ``ModelEmaV3``, ``torch.optim.swa_utils.AveragedModel`` and a torchvision-style
  ``ExponentialMovingAverage`` hold their own fp32 weights, averaged exactly as fp32 arithmetic would;
* timm's ``--resume`` (model, optimizer, then EMA) restores the live weights and continues the same run;
* in-place edits of the parameters (a WGAN clamp, a pruning mask, re-initialising a layer) are what the next
  forward and ``state_dict()`` see;
* a parameter group added after ``optimize()`` (or an optimizer built after it) trains like plain fp32;
* ``model.load_state_dict(A)`` then ``optimizer.load_state_dict(B)`` leaves ``A`` in the model.

Models are tiny (``DemoNet(width=8)`` on 16x16 images, batches of 8): bf16/fp16 are emulated on CPUs.
"""
import io

import pytest
import torch
import torch.nn.functional as F
from timm.utils import ModelEmaV3
from torch import nn
from torch.nn.utils import prune
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import aiak
from aiak.cli.demo import DemoNet, synthetic_dataset

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.dtype")

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH = 8
X, Y = synthetic_dataset(12 * BATCH, image_size=16, seed=1).tensors


def _strategy(level, dtype="bf16"):
    return {"precision": {"level": level, "dtype": dtype}}


def _net(seed=0):
    torch.manual_seed(seed)
    return DemoNet(width=8)


def _batch(i):
    i %= len(X) // BATCH
    return X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH]


def _step(model, optimizer, i):
    """One plain training step on batch ``i``; returns the loss."""
    x, y = _batch(i)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _state(model):
    """A detached copy of every tensor the model holds (parameters and buffers), by state_dict key."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _roundtrip(obj):
    """What a checkpoint file gives back: torch.save then torch.load (independent tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _optimized_copy(state_dict, strategy):
    """A freshly built network (other initial weights) loaded with ``state_dict`` and passed through aiak with
    ``strategy`` (no optimizer): how the given weights compute under that strategy."""
    fresh = _net(seed=123)
    fresh.load_state_dict(state_dict)
    fresh, _, _ = aiak.optimize(fresh, strategy=strategy)
    return fresh


def _storages(module):
    return {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}


# -- 1. EMA copies ---------------------------------------------------------------------------------------

DECAY = 0.9998


class TorchvisionEMA(AveragedModel):
    """torchvision's references/classification/utils.py ``ExponentialMovingAverage``, written out."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


class _Ema:
    """One EMA implementation, and the same average recomputed by hand in plain fp32 arithmetic."""

    def __init__(self, kind, model):
        self.kind = kind
        if kind == "timm_v3":
            self.ema = ModelEmaV3(model, decay=DECAY)
        elif kind == "swa_ema":
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        else:
            self.ema = TorchvisionEMA(model, DECAY)
        # what the EMA averages: timm all floating state_dict entries, AveragedModel its parameters (buffers are
        # copied from the live model), torchvision's parameters and buffers
        names = [n for n, _ in model.named_parameters()]
        if kind != "swa_ema":
            names += [n for n, b in model.named_buffers() if b.is_floating_point()]
        self.averaged = names
        self.expected = {n: v.detach().float().clone() for n, v in _named_tensors(model).items() if n in names}
        self.updates = 0

    @property
    def module(self):
        return self.ema.module

    def update(self, model, step):
        live = {n: t.detach() for n, t in _named_tensors(model).items()}
        if self.kind == "timm_v3":
            self.ema.update(model, step=step)  # step >= 2: decay is DECAY (no warmup)
            for n in self.averaged:
                self.expected[n] = torch.lerp(self.expected[n], live[n].float(), 1.0 - DECAY)
        else:
            first = self.updates == 0  # AveragedModel's first update copies the model
            self.ema.update_parameters(model)
            for n in self.averaged:
                if first:
                    self.expected[n] = live[n].float().clone()
                elif self.kind == "swa_ema":
                    self.expected[n] = torch.lerp(self.expected[n], live[n].float(), 1 - DECAY)
                else:
                    self.expected[n] = DECAY * self.expected[n] + (1 - DECAY) * live[n].float()
        self.updates += 1


def _named_tensors(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("kind", ["timm_v3", "swa_ema", "torchvision_ema"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ema_copy_holds_its_own_fp32_average(level, kind):
    """(a) the EMA's tensors are fp32, share no storage with the live model, equal the fp32 average computed by
    hand from the live model's parameters after each update (rtol 1e-6, atol 1e-9: the same formula, at most
    float rounding apart) and move at decay 0.9998 (more than 90% of the averaged elements change in the last
    update, ~99.7% here; a bf16 EMA changes none); (b) ``ema.module.state_dict()`` is the EMA's own weights;
    (c) the EMA computes with its own weights: its output differs from the live model's and equals a fresh
    network loaded with the EMA's state_dict through the same strategy (atol 1e-6, rtol 0); (d) loading a
    checkpoint into the EMA changes the EMA and leaves every tensor of the live model bit-identical."""
    strategy = _strategy(level)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
    ema = _Ema(kind, model)
    ema.update(model, step=100)  # AveragedModel: the first update copies; timm: one more decayed average
    before_last = None
    for i in range(3):
        _step(model, optimizer, i)
        before_last = {n: t.detach().clone() for n, t in _named_tensors(ema.module).items()}
        ema.update(model, step=101 + i)

    # (a) fp32, not shared, the fp32 average, and it moves
    own = _named_tensors(ema.module)
    for name, value in own.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, name
    assert not (_storages(ema.module) & _storages(model)), "the EMA shares tensors with the live model"
    for name in ema.averaged:
        torch.testing.assert_close(own[name].detach(), ema.expected[name], rtol=1e-6, atol=1e-9, msg=name)
    changed = sum(int(own[n].ne(before_last[n]).sum()) for n in ema.averaged)
    total = sum(own[n].numel() for n in ema.averaged)
    assert changed > 0.9 * total, f"the last EMA update changed only {changed}/{total} elements"

    # (b) the EMA's state_dict is its own weights
    sd = ema.module.state_dict()
    live_sd = model.state_dict()
    for name, value in sd.items():
        assert torch.equal(value, own[name]), name
        if value.is_floating_point():
            assert value.untyped_storage().data_ptr() == own[name].untyped_storage().data_ptr(), name
    assert any(not torch.equal(sd[n], live_sd[n]) for n, _ in model.named_parameters())

    # (c) it computes with its own weights
    x, _ = _batch(0)
    model.eval()
    ema.module.eval()
    with torch.no_grad():
        live_out, ema_out = model(x), ema.module(x)
        fresh_out = _optimized_copy(sd, strategy).eval()(x)
    model.train()
    assert ema_out.dtype == torch.float32
    assert not torch.equal(ema_out, live_out), "the EMA computes with the live model's weights"
    torch.testing.assert_close(ema_out, fresh_out, rtol=0, atol=1e-6)

    # (d) loading into the EMA leaves the live model alone
    live_before = _state(model)
    g = torch.Generator().manual_seed(5)
    ckpt = {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()) for k, v in sd.items()}
    ema.module.load_state_dict(ckpt)
    for name, value in ema.module.state_dict().items():
        assert torch.equal(value, ckpt[name]), name
    for name, value in model.state_dict().items():
        assert torch.equal(value, live_before[name]), f"loading the EMA changed the live model's {name}"


# -- 2. timm's --resume with an EMA ----------------------------------------------------------------------

@pytest.mark.parametrize("level", ["O1", "O2"])
def test_timm_resume_with_ema_restores_the_live_weights_and_continues_the_run(level):
    """Saved after k steps as timm saves (model, EMA, optimizer); restored as timm's ``--resume`` loads (model,
    optimizer, then ``model_ema.module``) into a freshly built and optimized model. The live model holds the
    saved live weights (exact), the EMA the saved EMA weights (exact), and the next step gives the same loss,
    weights and EMA as continuing the original run (exact: the same CPU ops on the same values); evaluating the
    resumed EMA gives the original EMA's output (exact), not the live model's."""
    strategy = _strategy(level)

    def build(seed):
        model = _net(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
        return model, optimizer, ModelEmaV3(model, decay=0.5)  # a low decay: EMA and live weights differ a lot

    model, optimizer, ema = build(0)
    k = 3
    for i in range(k):
        _step(model, optimizer, i)
        ema.update(model, step=10 + i)
    ckpt = _roundtrip({"model": model.state_dict(), "ema": ema.module.state_dict(),
                       "optimizer": optimizer.state_dict()})
    for name, _ in model.named_parameters():  # decay 0.5 after 3 steps: every EMA weight is its own average
        assert not torch.equal(ckpt["model"][name], ckpt["ema"][name]), f"the saved EMA's {name} is the live one"

    model2, optimizer2, ema2 = build(7)
    model2.load_state_dict(ckpt["model"])
    optimizer2.load_state_dict(ckpt["optimizer"])
    ema2.module.load_state_dict(ckpt["ema"])
    for name, value in model2.state_dict().items():
        assert torch.equal(value, ckpt["model"][name]), f"live {name} is not the saved live weight"
    for name, value in ema2.module.state_dict().items():
        assert torch.equal(value, ckpt["ema"][name]), f"EMA {name} is not the saved EMA weight"

    loss = _step(model, optimizer, k)
    ema.update(model, step=10 + k)
    loss2 = _step(model2, optimizer2, k)
    ema2.update(model2, step=10 + k)
    assert torch.equal(loss2, loss), (loss2, loss)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(ema.module.state_dict().items(), ema2.module.state_dict().values()):
        assert torch.equal(a, b), name

    # validating with the resumed EMA (as timm does after each epoch) is validating the original run's EMA
    x, _ = _batch(0)
    nets = (ema.module, ema2.module, model2, model)
    for net in nets:
        net.eval()
    with torch.no_grad():
        outs = [net(x) for net in nets[:3]]
    assert torch.equal(outs[1], outs[0])
    assert not torch.equal(outs[1], outs[2]), "the resumed EMA computes with the live model's weights"


# -- 3. in-place edits of the parameters ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_wgan_weight_clamp_is_what_state_dict_and_the_next_forward_see(dtype):
    """A WGAN critic clamps ``p.data`` to [-0.01, 0.01] after each step: every parameter and every parameter
    entry of ``state_dict()`` stays in range at every step, and the next step's loss equals (exactly) the loss
    of a fresh network loaded with the clamped state_dict through the same strategy."""
    strategy = _strategy("O2", dtype)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)

    def critic_loss(net, i):
        real, _ = _batch(i)
        fake = torch.randn(real.shape, generator=torch.Generator().manual_seed(100 + i))
        return net(fake).mean() - net(real).mean()

    param_names = [n for n, _ in model.named_parameters()]
    clamped_any = False
    for i in range(3):
        expected = None
        if i > 0:
            with torch.no_grad():
                expected = critic_loss(_optimized_copy(model.state_dict(), strategy), i)
        loss = critic_loss(model, i)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if expected is not None:
            assert torch.equal(loss.detach(), expected), (i, loss, expected)
        for p in model.parameters():
            clamped_any |= i > 0 and bool((p.detach().abs() > 0.01).any())  # a step left the range
            p.data.clamp_(-0.01, 0.01)
        sd = model.state_dict()
        for name in param_names:
            assert sd[name].abs().max() <= 0.01 and sd[name].dtype == torch.float32, (i, name)
        for name, p in model.named_parameters():
            assert p.abs().max() <= 0.01 and p.dtype == torch.float32, (i, name)
    assert clamped_any, "no step from clamped weights left the range: the clamp was never exercised"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_pruning_mask_applied_after_optimize_keeps_pruned_weights_zero(dtype):
    """``prune.l1_unstructured(module, "weight", amount=0.5)`` after optimize: after training steps the weight the
    forward computes with is exactly ``(weight_orig * weight_mask)`` in the half dtype, zero wherever the mask is;
    ``state_dict()`` holds fp32 ``weight_orig`` (the tensor the optimizer steps) and the unchanged mask, whose
    product is exactly zero at the pruned entries; the kept entries do train (>90% of them change)."""
    strategy = _strategy("O2", dtype)
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
    layers = {"features.1.0": model.features[1][0], "head.2": model.head[2]}
    used = {}
    for prefix, layer in layers.items():
        prune.l1_unstructured(layer, "weight", amount=0.5)
        layer.register_forward_pre_hook(lambda m, args, prefix=prefix: used.__setitem__(prefix, m.weight.detach()))
    start = _state(model)
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for i in range(3):
        _step(model, optimizer, i)
    with torch.no_grad():
        model(_batch(3)[0])
    sd = model.state_dict()
    for prefix, layer in layers.items():
        orig, mask = sd[prefix + ".weight_orig"], sd[prefix + ".weight_mask"]
        assert orig.dtype == torch.float32 and mask.dtype == torch.float32, prefix
        assert torch.equal(orig, layer.weight_orig) and id(layer.weight_orig) in stepped, prefix
        assert torch.equal(mask, start[prefix + ".weight_mask"]), prefix
        pruned = mask == 0
        assert pruned.float().mean() == 0.5
        assert torch.equal((orig * mask)[pruned], torch.zeros(int(pruned.sum()))), prefix
        weight = used[prefix]
        assert weight.dtype == HALF[dtype], prefix
        assert torch.equal(weight[pruned].float(), torch.zeros(int(pruned.sum()))), prefix
        assert torch.equal(weight, (orig * mask).to(HALF[dtype])), prefix
        kept_changed = orig.ne(start[prefix + ".weight_orig"])[~pruned].float().mean()
        assert kept_changed > 0.9, (prefix, kept_changed)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_reinitialising_a_layer_in_place_is_what_the_next_forward_uses(dtype):
    """``nn.init.zeros_(layer.weight)`` after a step: ``state_dict()`` shows zeros, the next forward computes with a
    zero weight (the head's output is then exactly its bias in the half dtype), and the step after it starts
    from zero: the weight becomes exactly ``-lr * grad`` (plain SGD)."""
    strategy = _strategy("O2", dtype)
    model = _net()
    lr = 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
    head = model.head[2]
    _step(model, optimizer, 0)
    nn.init.zeros_(head.weight)
    assert torch.equal(model.state_dict()["head.2.weight"], torch.zeros_like(head.weight))

    used = []
    head.register_forward_pre_hook(lambda m, args: used.append(m.weight.detach().clone()))
    x, y = _batch(1)
    out = model(x)
    assert len(used) == 1 and used[0].dtype == HALF[dtype] and not used[0].any()
    assert torch.equal(out, head.bias.detach().to(HALF[dtype]).float().expand_as(out))
    F.cross_entropy(out, y).backward()
    grad = head.weight.grad.clone()
    assert grad.dtype == torch.float32 and grad.isfinite().all() and grad.any()
    optimizer.step()
    optimizer.zero_grad()
    assert torch.equal(head.weight.detach(), torch.zeros_like(grad).add_(grad, alpha=-lr))


# -- 4. parameter groups added after optimize() ---------------------------------------------------------

# bf16 keeps 8 bits of mantissa: after a few small-lr steps the fp32 weights trained with bf16 compute agree with
# plain fp32 training to rtol 5e-2 / atol 5e-3, and each group's update (weights minus their start) agrees with
# plain fp32's to 15% in norm (plain torch.autocast(bf16) training of the same script lands 4-7% away; an update
# rounded away in bf16 weights is ~100% away).
def _assert_trains_like_fp32(groups, model, plain, start):
    named, plain_named = dict(model.named_parameters()), dict(plain.named_parameters())
    for group_name, names in groups.items():
        changed = sum(int(named[n].detach().ne(start[n]).sum()) for n in names)
        total = sum(named[n].numel() for n in names)
        assert changed > 0.99 * total, f"{group_name}: only {changed}/{total} elements changed"
        for n in names:
            assert named[n].dtype == torch.float32, n
            torch.testing.assert_close(named[n].detach(), plain_named[n].detach(), rtol=5e-2, atol=5e-3, msg=n)
        update = torch.cat([(named[n].detach() - start[n]).flatten() for n in names])
        plain_update = torch.cat([(plain_named[n].detach() - start[n]).flatten() for n in names])
        err = (update - plain_update).norm() / plain_update.norm()
        assert err < 0.15, f"{group_name}: update {err:.3f} away from plain fp32's (relative norm)"


def test_param_group_added_after_optimize_for_an_unfrozen_backbone_trains_like_fp32():
    """The backbone is frozen when the optimizer is built and optimized, trained head-only for 2 steps, then
    unfrozen and added with ``optimizer.add_param_group``; 3 more steps. Compared with the same script in plain
    fp32 (same weights, batches): both groups change (>99% of elements) and agree with fp32 (tolerances above)."""
    runs = []
    for use_aiak in (True, False):
        model = _net()
        for p in model.features.parameters():
            p.requires_grad_(False)
        optimizer = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
        if use_aiak:
            model, optimizer, _ = aiak.optimize(model, optimizer, strategy=_strategy("O2"))
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        for i in range(2):
            _step(model, optimizer, i)
        for p in model.features.parameters():
            p.requires_grad_(True)
        optimizer.add_param_group({"params": model.features.parameters()})
        for i in range(2, 5):
            _step(model, optimizer, i)
        runs.append((model, start))
    (model, start), (plain, _) = runs
    groups = {"backbone (added late)": [n for n, _ in model.features.named_parameters(prefix="features")],
              "head": [n for n, _ in model.head.named_parameters(prefix="head")]}
    _assert_trains_like_fp32(groups, model, plain, start)


def test_optimizer_built_after_optimize_without_one_trains_like_fp32():
    """``aiak.optimize(model)`` with no optimizer, then ``SGD(model.parameters())``: 3 steps agree with plain fp32
    training of the same model on the same batches (tolerances above), every element changing (>99%)."""
    runs = []
    for use_aiak in (True, False):
        model = _net()
        if use_aiak:
            model, none, _ = aiak.optimize(model, strategy=_strategy("O2"))
            assert none is None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        for i in range(3):
            _step(model, optimizer, i)
        runs.append((model, start))
    (model, start), (plain, _) = runs
    _assert_trains_like_fp32({"all": [n for n, _ in model.named_parameters()]}, model, plain, start)


# -- 5. checkpoint load order -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_optimizer_state_loaded_after_the_model_leaves_the_models_weights(dtype):
    """``model.load_state_dict(A)`` then ``optimizer.load_state_dict(B)``, B saved two steps after A: the model
    holds exactly A (state_dict and parameters), the optimizer B's momentum (and for fp16 B's loss-scaler state),
    and the next forward computes with A: its loss equals a fresh network loaded with A through the same
    strategy (exact)."""
    strategy = _strategy("O2", dtype)

    def build(seed):
        model = _net(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
        return model, optimizer

    model, optimizer = build(0)
    for i in range(2):
        _step(model, optimizer, i)
    a = _roundtrip(model.state_dict())
    for i in range(2, 4):
        _step(model, optimizer, i)
    b = _roundtrip(optimizer.state_dict())
    assert any(not torch.equal(a[n], p) for n, p in model.named_parameters())

    model2, optimizer2 = build(7)
    if dtype == "fp16":  # B's loss-scaler state (4 clean steps) is not a fresh scaler's
        assert optimizer2._aiak_steps.scaler.state_dict() != b["aiak"]["loss_scaler"]
    model2.load_state_dict(a)
    optimizer2.load_state_dict(b)
    for name, value in model2.state_dict().items():
        assert torch.equal(value, a[name]), f"{name} is not the loaded model state"
    for name, p in model2.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), a[name]), name
    for index, p in enumerate(p for g in optimizer2.param_groups for p in g["params"]):
        assert torch.equal(optimizer2.state[p]["momentum_buffer"], b["state"][index]["momentum_buffer"])
    if dtype == "fp16":
        assert optimizer2._aiak_steps.scaler.state_dict() == b["aiak"]["loss_scaler"]

    x, y = _batch(4)
    with torch.no_grad():
        expected = F.cross_entropy(_optimized_copy(a, strategy)(x), y)
    assert torch.equal(_step(model2, optimizer2, 4), expected)
