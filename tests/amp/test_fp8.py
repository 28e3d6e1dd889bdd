"""precision.fp8: torchao's float8 training recipes on a model's linear layers, emulated by torchao on this CPU.

The model is transformer-shaped (attention and feed-forward made of ``nn.Linear``) with layers fp8 must leave
alone: the first and last ``nn.Linear`` (the default ``fp8_skip``) and one whose width is not a multiple of 16.
Tolerances: fp8 (e4m3, 3 mantissa bits) rounds each product's inputs by up to 2**-4 relative; against bf16
(8 bits) the loss after 50 steps must be within 10% (the issue's bar), a converted layer's output SQNR against
fp32 must sit in fp8's range (15-35 dB; bf16 gives over 40), and where the same fp8 arithmetic runs twice
(a copy, a reload, a resume) the results must be equal bit for bit.
"""
import copy
import dataclasses
import functools
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import aiak
from aiak.amp.emulation import fp8_warning
from aiak.amp.fp8 import RECIPES, Float8Compute, plan_fp8
from aiak.runtime.class_swap import original_class

pytestmark = pytest.mark.filterwarnings("ignore:aiak. precision.fp8 on cpu is emulated")

D, FF, HEADS, T, B, IN, OUT = 64, 256, 4, 16, 8, 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).view(x.shape[0], x.shape[1], 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, D)           # the first Linear: skipped by default
        self.blocks = nn.Sequential(Block(), Block())
        self.squeeze = nn.Linear(D, 40)         # 40 is not a multiple of 16: never converted
        self.head = nn.Linear(40, OUT)          # the last Linear

    def forward(self, x):
        return self.head(F.gelu(self.squeeze(self.blocks(self.embed(x)))))


CONVERTED = [f"blocks.{i}.{name}" for i in range(2) for name in ("qkv", "proj", "fc1", "fc2")]


def batch(step, n=B):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, T, IN, generator=g)
    return x, target(x)


def target(x):
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(IN, 48, generator=g) / IN ** 0.5, torch.randn(48, OUT, generator=g) / 48 ** 0.5
    return torch.tanh(x @ w1) @ w2 + 0.5 * torch.tanh(x.mean(dim=1, keepdim=True) @ w1) @ w2


def build(precision, seed=0, **strategy):
    torch.manual_seed(seed)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"precision": precision, **strategy})
    return model, optimizer


def train(model, optimizer, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def fp8(recipe="rowwise", level="O2", **more):
    return {"level": level, "dtype": "bf16", "fp8": recipe, **more}


def sqnr_db(signal, noisy):
    return (10 * torch.log10(signal.float().pow(2).sum() / (signal.float() - noisy.float()).pow(2).sum())).item()


# -- training -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_trains_within_ten_percent_of_bf16_after_50_steps(recipe):
    bf16 = train(*build({"level": "O2", "dtype": "bf16"}), 50)
    ours = train(*build(fp8(recipe)), 50)
    assert ours[-1] < 0.3 * ours[0], ours[::10]  # it learns
    final, reference = sum(ours[-5:]) / 5, sum(bf16[-5:]) / 5
    assert abs(final - reference) <= 0.10 * reference, (final, reference)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_fp8_under_o0_and_o1_trains_and_returns_fp32(level):
    model, optimizer = build(fp8("tensorwise", level=level))
    assert [p for p, m in model.named_modules() if isinstance(m, Float8Compute)] == CONVERTED
    losses = train(model, optimizer, 30)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert model(batch(0)[0]).dtype == torch.float32


@pytest.mark.slow
def test_under_compile_it_trains_like_eager():
    """compile: true with fp8 (how it is fast on a GPU) compiles through the converted layers; on this CPU the
    losses of 5 steps match the eager run's within 1e-3 relative (inductor fuses the casts differently)."""
    eager = train(*build(fp8("tensorwise")), 5)
    compiled = train(*build(fp8("tensorwise"), compile=True), 5)
    for a, b in zip(compiled, eager):
        assert abs(a - b) <= 1e-3 * b, (compiled, eager)


# -- what is converted, and that it really computes in fp8 ----------------------------------------------------------
def test_eligible_layers_are_converted_in_place_and_the_others_left_alone_with_their_reasons():
    torch.manual_seed(0)
    plain = TinyTransformer()
    model = copy.deepcopy(plain)
    layers = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = {n: p for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    aiak.optimize(model, optimizer, strategy={"precision": fp8()})
    assert {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)} == layers  # the same objects
    assert {n: p for n, p in model.named_parameters()} == params
    for path, module in layers.items():
        if path in CONVERTED:
            assert type(module).__name__ == "Float8Linear" and original_class(module) is nn.Linear, path
        else:
            assert type(module) is nn.Linear, path
    plan = plan_fp8(plain, "rowwise")
    assert plan.converted == CONVERTED
    assert dict(plan.skipped) == {
        "embed": "the model's first Linear; precision.fp8_skip: first",
        "squeeze": "64x40: fp8 GEMMs need both dimensions multiples of 16",
        "head": "40x16: fp8 GEMMs need both dimensions multiples of 16"}


def test_fp8_skip_takes_paths_and_class_names_and_an_empty_list_converts_the_ends():
    torch.manual_seed(0)
    model = TinyTransformer()
    model.squeeze = nn.Linear(D, 48)  # eligible now, so only the skip list decides
    model.head = nn.Linear(48, OUT)
    by_path = plan_fp8(model, "rowwise", ["first", "last", "blocks.0"])
    assert by_path.converted == CONVERTED[4:] + ["squeeze"]
    assert dict(by_path.skipped)["blocks.0.fc1"] == "named by precision.fp8_skip"
    assert dict(by_path.skipped)["head"] == "the model's last Linear; precision.fp8_skip: last"
    assert plan_fp8(model, "rowwise", ["Block"]).converted == ["embed", "squeeze", "head"]  # no first, no last
    assert plan_fp8(model, "rowwise", []).converted == ["embed"] + CONVERTED + ["squeeze", "head"]


def test_layers_fp8_cannot_reach_are_left_alone():
    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(16, 32), nn.MultiheadAttention(32, 4), OwnForward(32, 32), nn.Linear(32, 32),
                          nn.Linear(32, 16))
    plan = plan_fp8(model, "tensorwise", [])
    assert plan.converted == ["0", "3", "4"]
    assert dict(plan.skipped) == {
        "1.out_proj": "inside nn.MultiheadAttention, which reads its weights without calling the layer",
        "2": "OwnForward has a forward of its own"}


def test_a_converted_layer_computes_in_fp8_and_a_skipped_one_as_before():
    torch.manual_seed(0)
    plain = TinyTransformer()
    model = copy.deepcopy(plain)
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  strategy={"precision": fp8("tensorwise", level="O0")})
    x = torch.randn(B, T, D)
    exact = plain.blocks[0].fc1(x)
    converted = sqnr_db(exact, model.blocks[0].fc1(x))
    bf16 = sqnr_db(exact, F.linear(x.bfloat16(), plain.blocks[0].fc1.weight.bfloat16(),
                                   plain.blocks[0].fc1.bias.bfloat16()))
    assert 15 < converted < 35 and bf16 > 40, (converted, bf16)  # measured: 28.7 and 51.1 dB
    xs = torch.randn(B, T, D)
    assert torch.equal(model.squeeze(xs), plain.squeeze(xs))  # skipped: the plain fp32 layer, exactly


# -- what scripts do with the model ---------------------------------------------------------------------------------
def test_state_dict_keys_and_dtypes_equal_the_plain_models_and_parameters_stay_fp32():
    torch.manual_seed(0)
    plain = TinyTransformer()
    model, optimizer = build(fp8())
    train(model, optimizer, 2)
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in theirs.items()}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loaded = TinyTransformer()
    loaded.load_state_dict(ours)  # a plain model loads an fp8 model's checkpoint
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ours.values()))


def test_resume_from_a_checkpoint_is_bit_identical():
    model, optimizer = build(fp8())
    train(model, optimizer, 5)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    straight = train(model, optimizer, 5, start=5)
    resumed_model, resumed_optimizer = build(fp8(), seed=123)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    assert train(resumed_model, resumed_optimizer, 5, start=5) == straight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed_model.state_dict().values()))


def test_hooks_on_a_converted_layer_still_run_and_eval_and_no_grad_work():
    torch.manual_seed(0)
    model = TinyTransformer()
    seen = []
    model.blocks[1].fc2.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"precision": fp8()})
    model(batch(0)[0])
    model.eval()
    with torch.no_grad():
        out = model(batch(1)[0])
    assert seen == [(B, T, D), (B, T, D)] and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_copies_and_a_whole_saved_model_compute_the_same(tmp_path):
    """An EMA copy (timm's ModelEmaV3, a deep copy) computes in fp8 like the model; ``torch.save`` of the whole model
    loads in a fresh process (the ``Float8Linear`` class is rebuilt there) and gives the same output."""
    from timm.utils import ModelEmaV3

    model, optimizer = build(fp8())
    ema = ModelEmaV3(model, decay=0.9)
    for step in range(3):
        train(model, optimizer, 1, start=step)
        ema.update(model)
    assert type(ema.module.blocks[0].qkv).__name__ == "Float8Linear"
    x = batch(9)[0]
    assert torch.equal(copy.deepcopy(model)(x), model(x))
    torch.save({"model": model, "x": x, "y": model(x).detach()}, tmp_path / "whole.pt")
    code = ("import torch, sys; d = torch.load(sys.argv[1], weights_only=False); "
            "print(type(d['model'].blocks[0].fc1).__name__, torch.equal(d['model'](d['x']), d['y']))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "whole.pt")], capture_output=True, text=True,
                         timeout=180)
    assert out.stdout.split() == ["Float8Linear", "True"], out.stderr[-2000:]


@pytest.mark.filterwarnings("ignore:aiak. grad_accumulation 2 without the loader")
def test_accumulation_and_clipping_equal_the_same_done_by_hand():
    """grad_accumulation 2 with the script's clip_grad_norm_ gives the update a script accumulating by hand gets
    with the same fp8 model (each micro-batch's loss halved, one clipped step)."""
    model, optimizer = build(fp8(), grad_accumulation=2)
    by_hand, hand_optimizer = build(fp8())
    for step in range(4):
        for micro in range(2):
            x, y = batch(10 * step + micro)
            F.mse_loss(model(x).float(), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            (F.mse_loss(by_hand(x).float(), y) / 2).backward()
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), 0.5)
        hand_optimizer.step()
        hand_optimizer.zero_grad()
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _ddp_rank(rank, world):
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"precision": fp8()})
    for step in range(3):
        x, y = batch(step, n=2 * B)
        F.mse_loss(model(x.chunk(world)[rank]).float(), y.chunk(world)[rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
    bare = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in bare.named_parameters()}, type(bare.blocks[0].qkv).__name__


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_on_two_gloo_ranks_ends_with_identical_weights():
    from tests.ranks import spawn_ranks

    (params0, cls0), (params1, cls1) = spawn_ranks(functools.partial(_ddp_rank), 2)
    assert cls0 == cls1 == "Float8Linear"
    for name in params0:
        assert torch.equal(params0[name], params1[name]), name


# -- real architectures ---------------------------------------------------------------------------------------------
def _timm_vit():
    import timm
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4,
                             num_classes=16), torch.randn(2, 3, 32, 32)


def _hf_bert():
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=16)
    return BertForSequenceClassification(config), torch.randint(0, 100, (2, 12))


def _torchvision_vit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                             num_classes=16), torch.randn(2, 3, 32, 32)


@pytest.mark.parametrize("make, expected", [(_timm_vit, 7), (_hf_bert, 12), (_torchvision_vit, 4)],
                         ids=["timm-vit", "hf-bert", "torchvision-vit"])
def test_real_architectures_convert_and_train(make, expected):
    """timm's ViT: qkv, proj, fc1 and fc2 of 2 blocks, less the first Linear (block 0's qkv; the patch embedding is
    a convolution) and the last (the head). Hugging Face BERT: query, key, value, attention output and the two
    feed-forward layers of 2 layers and the pooler, less the first (layer 0's query) and the last (the classifier).
    torchvision's ViT: its attention is nn.MultiheadAttention, so only the MLP's two layers per block, the head
    being the last. Each converts these and takes a training step."""
    torch.manual_seed(0)
    model, x = make()
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy={"precision": fp8()})
    converted = [p for p, m in model.named_modules() if isinstance(m, Float8Compute)]
    assert len(converted) == expected, converted
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    F.cross_entropy(logits.float(), torch.tensor([1, 3])).backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- mistakes, and where fp8 is slow --------------------------------------------------------------------------------
def test_a_misspelt_recipe_is_one_error_with_the_choices():
    with pytest.raises(Exception) as raised:
        build({"level": "O2", "dtype": "bf16", "fp8": "rowise"})
    text = str(raised.value)
    assert "precision.fp8" in text and all(r in text for r in ("off", *RECIPES)), text


def test_an_unknown_fp8_skip_entry_is_named_and_nothing_changes():
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"precision.fp8_skip: 'blocks.7' is neither a module class of this model "
                                         r"nor a module path \(did you mean 'blocks.1'\?\)"):
        aiak.optimize(model, optimizer, strategy={"precision": fp8(fp8_skip=["first", "blocks.7"])})
    assert all(type(m) in (nn.Linear, nn.LayerNorm, nn.Sequential, Block, TinyTransformer) for m in model.modules())


def test_without_torchao_fp8_names_the_extra_and_everything_else_works():
    """torchao hidden: fp8 asked for is one error naming the extra, and the model is as it was; the built-in fp8
    profile still loads and strategy='auto' still composes and applies (it once failed on every machine without
    torchao: the profile's fp8 was refused as a mistake of the file)."""
    code = ("import sys; sys.modules['torchao'] = None\n"
            "import torch, aiak\n"
            "from aiak.strategy import load_strategy\n"
            "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))\n"
            "try:\n"
            "    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=1), strategy={'precision': {'fp8': "
            "'rowwise'}})\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n"
            "print('classes', sorted({type(m).__name__ for m in model.modules()}))\n"
            "print('profile', load_strategy('fp8').precision.fp8)\n"
            "model, _, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=1), strategy='auto')\n"
            "print('auto', aiak.last_decision().strategy['precision']['fp8'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    lines = out.stdout.splitlines()
    assert lines[0] == ("ImportError aiak: precision.fp8 'rowwise' needs torchao, which is not installed: "
                        "pip install 'aiak[fp8]' (torchao)"), out.stdout + out.stderr[-3000:]
    assert lines[1:] == ["classes ['Linear', 'Sequential']", "profile tensorwise", "auto off"], out.stderr[-3000:]


def test_where_fp8_is_slow_it_says_so_once():
    cpu = fp8_warning(torch.device("cpu"), compiled=True)
    assert cpu[0] == "fp8-emulated" and "emulated by torchao" in cpu[1] and "5.4x slower" in cpu[1]
    ampere = fp8_warning(torch.device("cuda", 0), compiled=True, capability=(8, 0))
    assert ampere[0] == "fp8-emulated" and "compute capability 8.0" in ampere[1]
    assert fp8_warning(torch.device("cuda", 0), compiled=False, capability=(9, 0))[0] == "fp8-without-compile"
    assert fp8_warning(torch.device("cuda", 0), compiled=True, capability=(9, 0)) is None


# -- auto: the trials time fp8 against bf16, and the numerics gate judges it ----------------------------------------
def test_the_trials_time_a_pick_with_fp8_against_the_same_pick_without_it():
    from aiak.strategy import Strategy, probe
    from aiak.tune.candidates import candidate_strategies

    torch.manual_seed(0)
    model = TinyTransformer()
    found = probe(model, torch.optim.AdamW(model.parameters()))
    pick = Strategy.from_dict({"name": "pick", "extends": "default", "precision": fp8("tensorwise")})
    candidates = {c.label: c for c in candidate_strategies(pick, found, limit=8, max_seconds=None)}
    assert candidates["fp8=off"].strategy.precision.fp8 == "off"
    assert candidates["fp8=off"].changes == {k: v for k, v in candidates["pick"].changes.items()
                                             if k != "precision.fp8"}
    without = Strategy.from_dict({"name": "pick", "extends": "default", "precision": {"level": "O2", "dtype": "bf16"}})
    assert all(c.strategy.precision.fp8 == "off"
               for c in candidate_strategies(without, found, limit=8, max_seconds=None))  # never added by a variant


def _gradients(precision, x, y):
    from aiak.tune.gate import gradients

    torch.manual_seed(0)
    model = TinyTransformer()
    model, _, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                strategy={"precision": precision})
    F.mse_loss(model(x).float(), y).backward()
    return gradients(model)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_numerics_gate_passes_fp8_on_a_transformer(recipe):
    """Against plain fp32's gradient on the same batch, with the sampling noise of that batch (from its two halves):
    fp8's error stays well inside the noise and its scale near 1, as bf16's does."""
    from aiak.tune.gate import compare, sampling_noise

    x, y = batch(0, n=16)
    fp32 = _gradients({"level": "O0"}, x, y)
    halves = [_gradients({"level": "O0"}, x[i::2], y[i::2]) for i in range(2)]
    noise = sampling_noise(halves[0], halves[1], 8, 8, 16)
    result = compare(_gradients(fp8(recipe), x, y), fp32, noise)
    bf16 = compare(_gradients({"level": "O2", "dtype": "bf16"}, x, y), fp32, noise)
    assert result.passed and result.error_to_noise < 0.5 and abs(result.scale - 1) < 0.05, result
    assert result.error_to_noise > bf16.error_to_noise, (result, bf16)  # fp8 rounds more than bf16


def own_line(decision, knob):
    return next(effect for name, _, effect in decision.effects if name == knob)


def test_explain_says_what_fp8_trades_and_which_layers_stay_in_high_precision():
    from aiak.api import explain

    torch.manual_seed(0)
    model = TinyTransformer()
    planned = explain(model, torch.optim.AdamW(model.parameters()), strategy={"precision": fp8()})
    assert "trades: throughput of the linear layers' matrix multiplications" in planned.knobs["precision.fp8"]["reason"]
    said = own_line(planned, "precision.fp8")
    assert said.startswith("would convert 8 Linear layer(s) in fp8 rowwise; left in high precision: embed (the "
                           "model's first Linear; precision.fp8_skip: first); squeeze (64x40"), said
    assert all(type(m) in (nn.Linear, nn.LayerNorm, nn.Sequential, Block, TinyTransformer) for m in model.modules())
    aiak.optimize(model, torch.optim.AdamW(model.parameters()), strategy={"precision": fp8()})
    assert own_line(aiak.last_decision(), "precision.fp8") == said[len("would convert "):]


# -- the same numbers as torchao's own conversion -------------------------------------------------------------------
def _torchao_twin(model, recipe):
    """``model`` converted by torchao's own ``convert_to_float8_training`` (emulated), with aiak's eligibility."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = set(plan_fp8(model, recipe, []).converted)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name in converted)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_layers_compute_exactly_what_torchaos_own_float8_linear_computes(recipe):
    """aiak keeps the user's modules and swaps their class; torchao's conversion builds new Float8Linear modules.
    The outputs and every gradient agree to float rounding of the same ops (rtol 1e-5), on the transformer and
    on a block called twice in one forward."""
    for make in (TinyTransformer, lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32),
                                                        nn.Tanh(), nn.Linear(32, 16))):
        torch.manual_seed(0)
        ours = make()
        theirs = _torchao_twin(copy.deepcopy(ours), recipe)
        aiak.optimize(ours, torch.optim.SGD(ours.parameters(), lr=0.1),
                      strategy={"precision": {"level": "O0", "fp8": recipe, "fp8_skip": []}})
        assert sum(isinstance(m, Float8Compute) for m in ours.modules()) == \
            sum(type(m).__name__ == "Float8Linear" for m in theirs.modules()) > 0
        x = torch.randn(B, T, IN) if isinstance(ours, TinyTransformer) else torch.randn(B, 16)
        out, ref = ours(x), theirs(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_gradient_penalty_through_an_fp8_layer_is_refused_naming_the_layer_and_the_fix():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"precision": fp8()})
    x = torch.randn(8, 16, requires_grad=True)
    model(x).sum().backward()  # first-order training is fine
    with pytest.raises(RuntimeError, match=r"'2' computes in fp8 .* create_graph=True .* precision.fp8_skip"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    skipped = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    aiak.optimize(skipped, torch.optim.SGD(skipped.parameters(), lr=0.1),
                  strategy={"precision": fp8(fp8_skip=["first", "last", "2"])})
    g, = torch.autograd.grad(skipped(x).sum(), x, create_graph=True)  # what the error advises works
    g.norm().backward()


def test_a_parametrized_linear_is_left_alone():
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(nn.Linear(16, 32), weight_norm(nn.Linear(32, 32)), nn.Linear(32, 32), nn.Linear(32, 16))
    plan = plan_fp8(model, "tensorwise", [])
    assert plan.converted == ["0", "2", "3"]
    assert dict(plan.skipped)["1"].startswith("parametrized")
