"""aiak.ops.replace_window_attention / apply_fused_ops on real third-party Swin models.

Hugging Face transformers, timm and torchvision classes are the real ones (random weights, nothing
downloaded; the test extra installs all three, so they are imported unconditionally: a missing library
is a failure, not a skip). Reference modules (swin_reference_modules.py) stand in only for code that
pip cannot install here: the original Swin-Transformer repository and the transformers 4.x layout.

Equivalence is checked in float64 (the fused torch path is one SDPA call, so float64 agrees with eager
to ~1e-12): outputs, every parameter gradient, unchanged state_dict keys and parameter identity.
"""
import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import transformers
from timm.models import beit as timm_beit
from timm.models import swin_transformer as timm_swin
from torch import nn
from torchvision.models import swin_transformer as tv_swin

import aiak.ops as ops

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("swin_reference_modules", Path(__file__).with_name("swin_reference_modules.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


def _assert_equivalent(original, fused, make_input, loss=lambda out: out.pow(2).sum(), atol=1e-10):
    """Same output and same gradient for every parameter (matched by name) on the same input."""
    outs, grads = [], []
    for model in (original, fused):
        model.zero_grad(set_to_none=True)
        out = model(make_input())
        loss(out).backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=0)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=atol, rtol=1e-9,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _assert_fused_in_eval_original_in_training(model, fused, x):
    """With attention dropout: eval outputs and gradients match; training draws the same dropout masks as
    the original (so the original forward ran, not the fused one)."""
    _assert_equivalent(model.eval(), fused.eval(), lambda: x)
    torch.manual_seed(1)
    a = model.train()(x)
    torch.manual_seed(1)
    b = fused.train()(x)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def _surgery_keeps_state(model):
    keys_before = list(model.state_dict().keys())
    params_before = [id(p) for p in model.parameters()]
    count = ops.replace_window_attention(model)
    assert list(model.state_dict().keys()) == keys_before
    assert [id(p) for p in model.parameters()] == params_before  # an optimizer built earlier stays valid
    return count


def _fused_names(model):
    return [n for n, m in model.named_modules() if type(m).__name__.startswith("Fused")]


def _spread_bias_tables(model, std=0.5):
    """Libraries initialise the tables to zero or N(0, 0.02), which barely moves the scores: give the
    bias something to get wrong."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_(0, std)
    return model


# ---------------------------------------------------------------------------------------------- HF

def _hf_swin(**overrides):
    config = transformers.SwinConfig(image_size=56, patch_size=4, embed_dim=24, depths=[2, 2], num_heads=[2, 4],
                                     window_size=7, num_labels=5, drop_path_rate=0.0,
                                     **overrides)
    torch.manual_seed(0)
    return _spread_bias_tables(transformers.SwinForImageClassification(config).double())


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hugging_face_swin_output_and_grads_match(attn_implementation):
    model = _hf_swin()
    model.config._attn_implementation = attn_implementation
    # Stage 1 is 14x14 with window 7: the second block uses the shift mask, so the mask path is exercised.
    shifted = [layer for layer in model.swin.encoder.layers[0].blocks if layer.shift_size > 0]
    assert shifted, "the test model must contain a shifted-window block"
    fused = copy.deepcopy(model)
    assert _surgery_keeps_state(fused) == 4
    assert all(type(m).__name__ == "FusedSwinAttention" for m in
               (blk.attention for stage in fused.swin.encoder.layers for blk in stage.blocks))
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    _assert_equivalent(model.train(), fused.train(), lambda: x, loss=lambda out: out.logits.pow(2).sum())


def test_hugging_face_swin_training_step_with_optimizer_built_before_surgery():
    model = _hf_swin()
    baseline = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_base = torch.optim.SGD(baseline.parameters(), lr=0.1)
    ops.replace_window_attention(model)
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    for _ in range(2):
        for m, o in ((model, opt), (baseline, opt_base)):
            o.zero_grad()
            m(x).logits.logsumexp(-1).sum().backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), baseline.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0, msg=name)


def test_hugging_face_swinv2_is_left_alone_with_a_warning(said):
    config = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2],
                                       window_size=4, num_labels=3)
    model = transformers.Swinv2ForImageClassification(config)
    with said:
        assert ops.replace_window_attention(model) == 0
    assert "Swinv2SelfAttention" in said.text and "cosine attention" in said.text
    assert not _fused_names(model)


def test_restore_returns_the_original_classes():
    model = _hf_swin()
    ops.replace_window_attention(model)
    assert ops.restore_window_attention(model) == 4
    assert not _fused_names(model)
    assert ops.replace_window_attention(model) == 4
    assert ops.replace_window_attention(model) == 0  # already fused: not counted twice


@pytest.mark.slow
def test_whole_fused_model_pickles_into_a_fresh_process(tmp_path):
    model = _hf_swin()
    ops.replace_window_attention(model)
    x = torch.randn(1, 3, 56, 56, dtype=torch.float64)
    torch.save({"model": model, "x": x, "y": model.eval()(x).logits}, tmp_path / "model.pt")
    code = ("import torch\n"
            f"saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
            "m = saved['model']\n"
            "assert type(m.swin.encoder.layers[0].blocks[0].attention).__name__ == 'FusedSwinAttention'\n"
            "torch.testing.assert_close(m(saved['x']).logits, saved['y'], atol=1e-12, rtol=0)\n"
            "print('OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "OK", proc.stderr[-2000:]


# ------------------------------------------------------------------------- original Swin-Transformer

def _original_model(attn_drop=0.0):
    torch.manual_seed(0)
    return nn.Sequential(
        ref.OriginalSwinBlock(32, (14, 14), num_heads=2, window_size=7, shift_size=0, attn_drop=attn_drop),
        ref.OriginalSwinBlock(32, (14, 14), num_heads=2, window_size=7, shift_size=3, attn_drop=attn_drop),
    ).double()


def test_original_swin_code_output_and_grads_match():
    model = _original_model()
    fused = copy.deepcopy(model)
    assert _surgery_keeps_state(fused) == 2
    assert _fused_names(fused) == ["0.attn", "1.attn"]
    assert isinstance(fused[0].attn, ref.OriginalWindowAttention)
    x = torch.randn(3, 14 * 14, 32, dtype=torch.float64)
    _assert_equivalent(model, fused, lambda: x)


def test_attention_dropout_runs_fused_in_eval_and_original_in_training(said):
    model = _original_model(attn_drop=0.5)
    fused = copy.deepcopy(model)
    with said:
        assert ops.replace_window_attention(fused) == 2
    assert "fused only in eval mode" in said.text and "0.attn" in said.text
    x = torch.randn(2, 14 * 14, 32, dtype=torch.float64)
    _assert_fused_in_eval_original_in_training(model, fused, x)


def test_original_repo_swinv2_cosine_attention_is_left_alone_with_a_warning(said):
    model = nn.Sequential(ref.CosineWindowAttention(16, (4, 4), 2), ref.OriginalWindowAttention(16, (4, 4), 2))
    with said:
        assert ops.replace_window_attention(model) == 1
    assert "0 (CosineWindowAttention): SwinV2 cosine attention" in said.text
    assert _fused_names(model) == ["1"]


# --------------------------------------------------------------------------- transformers 4.x layout

def test_hf4_swin_self_attention_matches_including_fallbacks():
    torch.manual_seed(0)
    module = ref.HF4SwinSelfAttention(dim=32, num_heads=4, window_size=7).double()
    fused = copy.deepcopy(module)
    assert _surgery_keeps_state(fused) == 1
    x = torch.randn(8, 49, 32, dtype=torch.float64)
    mask = torch.where(torch.rand(4, 49, 49) > 0.3, 0.0, -100.0).double()
    _assert_equivalent(module, fused, lambda: x, loss=lambda out: out[0].pow(2).sum())
    _assert_equivalent(lambda_module(module, mask), lambda_module(fused, mask), lambda: x)
    # output_attentions needs the probabilities: the original forward answers it.
    out, probs = fused(x, mask, output_attentions=True)
    assert probs.shape == (8, 4, 49, 49)


class lambda_module(nn.Module):
    def __init__(self, inner, mask):
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x):
        return self.inner(x, self.mask)[0]


# ---------------------------------------------------------------------------------------------- timm

def _timm_swin(fused_attn=False, **overrides):
    torch.manual_seed(0)
    kwargs = dict(pretrained=False, img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=5,
                  drop_path_rate=0.0)
    model = timm.create_model("swin_tiny_patch4_window7_224", **dict(kwargs, **overrides))
    model = _spread_bias_tables(model.double())
    for module in model.modules():
        if isinstance(module, timm_swin.WindowAttention):
            module.fused_attn = fused_attn  # timm's own choice between its eager and its SDPA forward
    return model


@pytest.mark.parametrize("fused_attn", [False, True], ids=["timm-eager", "timm-sdpa"])
def test_timm_swin_output_and_grads_match(fused_attn):
    model = _timm_swin(fused_attn)
    # Stage 1 is 14x14 with window 7: the second block is shifted, so the shift mask reaches the fused op.
    assert [blk.shift_size for blk in model.layers[0].blocks] == [(0, 0), (3, 3)]
    fused = copy.deepcopy(model)
    assert _surgery_keeps_state(fused) == 4
    assert all(type(m).__name__ == "FusedWindowAttention" and isinstance(m, timm_swin.WindowAttention)
               for m in (blk.attn for stage in fused.layers for blk in stage.blocks))
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    _assert_equivalent(model.train(), fused.train(), lambda: x)


def test_timm_attention_dropout_runs_fused_in_eval_and_original_in_training(said):
    model = _timm_swin(attn_drop_rate=0.5)
    fused = copy.deepcopy(model)
    with said:
        assert ops.replace_window_attention(fused) == 4
    assert "fused only in eval mode" in said.text and "layers.0.blocks.1.attn (WindowAttention) p=0.5" in said.text
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    _assert_fused_in_eval_original_in_training(model, fused, x)


def test_timm_swinv2_is_left_alone_with_a_warning(said):
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=32, embed_dim=16, depths=(2,),
                              num_heads=(2,), window_size=4, num_classes=3)
    with said:
        assert ops.replace_window_attention(model) == 0
    assert "layers.0.blocks.0.attn (WindowAttention): SwinV2 cosine attention" in said.text
    assert not _fused_names(model)


def test_timm_beit_attention_is_a_look_alike_and_not_fused(said):
    # BEiT's relative-position table has 3 class-token rows and q/v get their own biases: it has Swin's
    # attribute names but is global attention, not window attention.
    torch.manual_seed(0)
    model = nn.Sequential(timm_beit.Attention(16, num_heads=2, qkv_bias=True, window_size=(4, 4)),
                          timm_swin.WindowAttention(16, num_heads=2, window_size=4))
    with said:
        assert ops.replace_window_attention(model) == 1
    assert "0 (Attention): unrecognised window-attention structure" in said.text
    assert _fused_names(model) == ["1"]


# --------------------------------------------------------------------------------------- torchvision

@pytest.mark.parametrize("height,width,shift", [(14, 14, [3, 3]), (10, 13, [3, 3]), (7, 12, [3, 3]), (14, 14, [0, 0])],
                         ids=["shifted", "padded", "one-window-row", "no-shift"])
def test_torchvision_shifted_window_attention_matches(height, width, shift):
    # The fused forward re-implements torchvision's padding, cyclic shift, partition and shift mask.
    torch.manual_seed(0)
    module = _spread_bias_tables(tv_swin.ShiftedWindowAttention(32, [7, 7], shift, num_heads=4).double())
    fused = copy.deepcopy(module)
    assert _surgery_keeps_state(fused) == 1
    x = torch.randn(2, height, width, 32, dtype=torch.float64)
    _assert_equivalent(module, fused, lambda: x)


def test_torchvision_dropout_is_left_alone(said):
    module = tv_swin.ShiftedWindowAttention(32, [7, 7], [3, 3], num_heads=4, dropout=0.1)
    with said:
        assert ops.replace_window_attention(module) == 0
    assert "<root> (ShiftedWindowAttention): dropout p=0.1" in said.text


def test_torchvision_swin_output_and_grads_match():
    torch.manual_seed(0)
    model = tv_swin.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                    window_size=[7, 7], stochastic_depth_prob=0.0, num_classes=5)
    model = _spread_bias_tables(model.double())
    fused = copy.deepcopy(model)
    assert _surgery_keeps_state(fused) == 4
    assert all(type(m).__name__ == "FusedShiftedWindowAttention" for m in fused.modules()
               if isinstance(m, tv_swin.ShiftedWindowAttention))
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    _assert_equivalent(model.train(), fused.train(), lambda: x)


def test_torchvision_swinv2_is_left_alone_with_a_warning(said):
    model = tv_swin.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2], num_heads=[2], window_size=[4, 4],
                                    num_classes=3, block=tv_swin.SwinTransformerBlockV2,
                                    downsample_layer=tv_swin.PatchMergingV2)
    with said:
        assert ops.replace_window_attention(model) == 0
    assert "features.1.0.attn (ShiftedWindowAttentionV2): SwinV2 cosine attention" in said.text
    assert not _fused_names(model)


# -------------------------------------------------------------------------------- apply_fused_ops

def test_apply_fused_ops_counts_and_warns_when_nothing_matches(said):
    assert ops.apply_fused_ops(_original_model(), ["window_attention"]) == {"window_attention": 2}
    with said:
        assert ops.apply_fused_ops(nn.Linear(4, 4), ["window_attention"]) == {"window_attention": 0}
    assert "window_attention replaced nothing in Linear" in said.text


def test_apply_fused_ops_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['flash'\]; valid choices: \['window_attention', "
                                         r"'linear_cross_entropy', 'pointwise_conv'\]"):
        ops.apply_fused_ops(nn.Linear(4, 4), ["flash"])


def test_surgery_refuses_wrapped_models():
    with pytest.raises(TypeError, match="already wrapped in DataParallel"):
        ops.apply_fused_ops(nn.DataParallel(_original_model()), ["window_attention"])


@pytest.mark.slow
def test_surgery_refuses_a_distributed_data_parallel_model():
    code = (
        "import torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "import aiak.ops as ops\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        "model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))\n"
        "try:\n"
        "    ops.apply_fused_ops(model, ['window_attention'])\n"
        "except TypeError as err:\n"
        "    print('REFUSED', err)\n"
        "dist.destroy_process_group()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert "REFUSED" in proc.stdout and "DistributedDataParallel" in proc.stdout, proc.stdout + proc.stderr
