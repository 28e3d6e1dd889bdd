"""``aiak.cli.model_spec``: every SPEC form builds a real model (random weights, nothing downloaded) with a loader of
the right kind of synthetic data; bad SPECs give one clear error."""
import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from aiak.cli import model_spec
from aiak.cli.model_spec import ModelSpecError, build, compute_loss


def _first_batch(setup):
    return next(iter(setup.loader))


def _trains_one_step(setup):
    """A real step works end to end: finite loss, every trainable parameter gets a gradient, weights move."""
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    loss = compute_loss(setup.model, _first_batch(setup))
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in setup.model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing[:5]
    setup.optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in setup.model.named_parameters())


def _fusable_window_attention(model):
    """How many modules aiak's surgery would fuse (on a copy): what makes ``auto`` pick window_attention."""
    from aiak import ops

    return ops.replace_window_attention(copy.deepcopy(model))


# ---------------------------------------------------------------------------------------------- demo

def test_demo_is_demonet_on_32px_images_with_sgd():
    from aiak.cli.demo import DemoNet

    setup = build("demo")
    assert isinstance(setup.model, DemoNet) and setup.input_shape == (3, 32, 32) and setup.batch_size == 64
    x, y = _first_batch(setup)
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < 10
    assert len(setup.loader) == model_spec.BATCHES_PER_SETUP  # default samples: 16 batches, none partial
    opt = setup.optimizer
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.01 and opt.defaults["momentum"] == 0.9
    params = sum(p.numel() for p in setup.model.parameters())
    assert setup.description.startswith("demo: DemoNet") and f"{params / 1e3:.1f}K parameters" in setup.description
    assert "3x32x32" in setup.description and "batch 64" in setup.description
    _trains_one_step(setup)


def test_batch_size_samples_and_input_shape_are_honoured():
    setup = build("demo", batch_size=8, samples=20, input_shape=(3, 16, 24))
    assert len(setup.loader) == 2  # 20 samples in batches of 8, the partial batch dropped
    assert [tuple(x.shape) for x, _ in setup.loader] == [(8, 3, 16, 24)] * 2


def test_same_seed_same_model_and_data_and_the_callers_rng_is_untouched():
    state = torch.get_rng_state()
    a, b = build("demo", seed=3), build("demo", seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name
    (xa, ya), (xb, yb) = _first_batch(a), _first_batch(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = build("demo", seed=4)
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))


def test_synthetic_images_are_learnable():
    """Class k is pattern k plus noise: the nearest pattern names the label for almost every sample."""
    data = model_spec.SyntheticImages(200, (3, 8, 8), num_classes=10, seed=0)
    images = torch.stack([data[i][0] for i in range(len(data))])
    labels = torch.stack([data[i][1] for i in range(len(data))])
    nearest = torch.cdist(images.flatten(1), data.patterns.flatten(1)).argmin(1)
    assert (nearest == labels).float().mean() > 0.95
    assert torch.equal(data[7][0], data[7][0])  # a sample is a function of (seed, index)
    clean = model_spec.SyntheticImages(5, (3, 8, 8), num_classes=10, seed=0, noise=0.0)
    assert all(torch.equal(clean[i][0], clean.patterns[clean[i][1]]) for i in range(5))


def test_synthetic_text_is_learnable_and_padded_at_the_end():
    data = model_spec.SyntheticText(200, 32, vocab_size=1000, num_classes=3, seed=0)
    hits = 0
    for i in range(len(data)):
        s = data[i]
        real = int(s["attention_mask"].sum())
        assert 16 <= real <= 32 and bool((s["attention_mask"][:real] == 1).all())
        assert bool((s["input_ids"][real:] == 0).all()) and bool((s["input_ids"][:real] > 0).all())
        counts = torch.stack([(s["input_ids"] == k).sum() for k in data.keywords])
        hits += int(counts.argmax() == s["labels"])
    assert hits / len(data) > 0.95


# ---------------------------------------------------------------------------------------------- timm

def test_timm_swin_takes_the_input_size_at_construction_and_gets_adamw():
    setup = build("timm:swin_tiny_patch4_window7_224", input_shape=(3, 64, 64), batch_size=2, samples=4)
    assert tuple(setup.model.patch_embed.img_size) == (64, 64)
    assert _fusable_window_attention(setup.model) == 12  # swin-tiny: depths 2, 2, 6, 2
    opt = setup.optimizer
    assert type(opt) is torch.optim.AdamW and opt.defaults["lr"] == 5e-4 and opt.defaults["weight_decay"] == 0.05
    assert "timm SwinTransformer" in setup.description and "3x64x64" in setup.description
    assert tuple(_first_batch(setup)[0].shape) == (2, 3, 64, 64)
    _trains_one_step(setup)


def test_timm_cnn_default_input_comes_from_its_pretrained_cfg_and_channels_are_passed():
    setup = build("timm:resnet18", batch_size=2, samples=2)
    assert setup.input_shape == (3, 224, 224) and type(setup.optimizer) is torch.optim.SGD
    setup = build("timm:resnet18", input_shape=(1, 32, 48), batch_size=2, samples=2)  # no img_size argument
    assert setup.model.conv1.in_channels == 1
    assert tuple(_first_batch(setup)[0].shape) == (2, 1, 32, 48)
    _trains_one_step(setup)


def test_timm_inception_default_input_is_299():
    assert build("timm:inception_v3", batch_size=1, samples=1).input_shape == (3, 299, 299)


# ---------------------------------------------------------------------------------------------- torchvision

def test_torchvision_models_build_at_the_requested_size():
    setup = build("torchvision:resnet18", input_shape=(3, 64, 64), batch_size=2, samples=2)
    assert type(setup.model).__name__ == "ResNet" and type(setup.optimizer) is torch.optim.SGD
    _trains_one_step(setup)
    swin = build("torchvision:swin_t", input_shape=(3, 64, 64), batch_size=2, samples=2)
    assert _fusable_window_attention(swin.model) == 12 and type(swin.optimizer) is torch.optim.AdamW
    vit = build("torchvision:vit_b_32", input_shape=(3, 64, 64), batch_size=1, samples=1)
    assert vit.model.image_size == 64  # ViT fixes its position embedding at construction
    assert build("torchvision:resnet18", batch_size=1, samples=1).input_shape == (3, 224, 224)


# ---------------------------------------------------------------------------------------------- Hugging Face

def test_hf_swin_uses_the_auto_image_classification_head_and_fits_its_window():
    setup = build("hf:swin", input_shape=(3, 64, 64), batch_size=2, samples=2)
    assert type(setup.model).__name__ == "SwinForImageClassification"
    assert setup.model.config.image_size == 64 and setup.model.config.window_size == 2
    assert "window_size 7 -> 2" in setup.description
    assert _fusable_window_attention(setup.model) == 12
    _trains_one_step(setup)
    assert build("hf:swin", batch_size=1, samples=1).model.config.window_size == 7  # 224: untouched


def test_hf_text_model_gets_token_batches_with_mask_and_labels():
    setup = build("hf:distilbert", input_shape=(24,), batch_size=4, samples=8)
    assert type(setup.model).__name__ == "DistilBertForSequenceClassification" and setup.kind == "text"
    assert type(setup.optimizer) is torch.optim.AdamW and setup.input_shape == (24,)
    batch = _first_batch(setup)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (4, 24) and batch["input_ids"].dtype == torch.int64
    assert int(batch["input_ids"].max()) < setup.model.config.vocab_size
    assert int(batch["labels"].max()) < setup.model.config.num_labels
    assert "24 tokens" in setup.description
    _trains_one_step(setup)


def test_no_family_downloads_anything():
    """Built with every socket refused: a download attempt would raise."""
    code = textwrap.dedent("""
        import socket
        def refuse(*a, **k):
            raise OSError("network use during model_spec.build")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        from aiak.cli.model_spec import build
        for spec in ("timm:resnet18", "torchvision:resnet18", "hf:swin", "hf:distilbert"):
            build(spec, batch_size=1, samples=1, input_shape=(16,) if spec == "hf:distilbert" else (3, 64, 64))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- file factories

def test_file_factory_returning_a_module_or_a_module_and_shape(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent("""
        from torch import nn
        def mlp():
            return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4))
        def gray():
            model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
            return model, (1, 12, 12)
        def not_a_model():
            return 42
    """))
    setup = build(f"{path}:mlp", input_shape=(3, 8, 8), batch_size=4, samples=8)
    x, y = _first_batch(setup)
    assert x.shape == (4, 3, 8, 8) and int(y.max()) < 4  # labels only where the head has classes
    _trains_one_step(setup)
    gray = build(f"{path}:gray", batch_size=2, samples=2)
    assert gray.input_shape == (1, 12, 12) and tuple(_first_batch(gray)[0].shape) == (2, 1, 12, 12)
    with pytest.raises(ModelSpecError, match=r"must return an nn.Module .* got int"):
        build(f"{path}:not_a_model")
    with pytest.raises(ModelSpecError, match=r"has no function 'mpl' \(did you mean 'mlp'\?\)"):
        build(f"{path}:mpl")
    with pytest.raises(ModelSpecError, match=r"does not take images of shape 3x224x224"):
        build(f"{path}:mlp")  # default 3x224x224 does not fit its Linear: said now, not in the first step


# ---------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("spec, message", [
    ("timm:resnt18", r"timm has no model 'resnt18' \(did you mean 'resnet18'\?\)"),
    ("torchvision:resnt18", r"torchvision has no classification model 'resnt18' \(did you mean 'resnet18'\?\)"),
    ("torchvision:fasterrcnn_resnet50_fpn", r"detection, segmentation"),
    ("hf:swim", r"'swim' is not a transformers model type .*did you mean 'swin'"),
    ("hf:vit_mae", r"'vit_mae' is a transformers model type without an image- or sequence-classification head"),
    ("hf:microsoft/swin-tiny-patch4-window7-224", r"not a Hub repository \(nothing is downloaded\)"),
    ("tim:resnet18", r"unknown model spec 'tim:resnet18' \(did you mean 'timm'\?\); the forms are demo, timm:NAME"),
    ("resnet18", r"unknown model spec 'resnet18'; the forms are demo, timm:NAME, torchvision:NAME, hf:NAME"),
    ("missing.py:factory", r"no file 'missing.py'"),
])
def test_bad_spec_is_one_clear_error(spec, message):
    with pytest.raises(ModelSpecError, match=message):
        build(spec)


def test_bad_sizes_are_refused_with_the_valid_forms():
    with pytest.raises(ModelSpecError, match=r"model 'demo' takes 3-channel images"):
        build("demo", input_shape=(1, 32, 32))
    with pytest.raises(ModelSpecError, match=r"takes text: the input shape is one number"):
        build("hf:distilbert", input_shape=(3, 32, 32))
    with pytest.raises(ModelSpecError, match=r"takes images: the input shape is C,H,W"):
        build("demo", input_shape=(32,))
    with pytest.raises(ModelSpecError, match=r"batch size must be >= 1, got 0"):
        build("demo", batch_size=0)
    with pytest.raises(ModelSpecError, match=r"samples \(4\) must be at least the batch size \(8\)"):
        build("demo", batch_size=8, samples=4)
    assert model_spec.parse_input_shape("3,64,64") == (3, 64, 64) and model_spec.parse_input_shape("128") == (128,)
    for text in ("3,64", "a,b,c", "3,0,64", ""):
        with pytest.raises(ModelSpecError, match=r"bad input shape .* C,H,W for images"):
            model_spec.parse_input_shape(text)


def test_a_missing_library_names_what_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["timm"] = None  # as if timm were not installed: importing it raises ImportError
        from aiak.cli.model_spec import ModelSpecError, build
        try:
            build("timm:resnet18")
        except ModelSpecError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "model 'timm:resnet18' needs timm, which is not installed" in out.stdout, out.stderr
    # the hint keeps the installed torch: a bare `pip install timm` would resolve a torchvision for another torch
    # and replace this one (beside the 2.13.0 CPU wheel: a CUDA build of several GB)
    from importlib import metadata
    base, _, build = metadata.version("torch").partition("+")   # what pip compares (PyPI's CUDA build: no tag)
    assert f'pip install timm "torch=={base}"' in out.stdout, out.stdout
    assert (f"--extra-index-url https://download.pytorch.org/whl/{build}" in out.stdout) == bool(build), out.stdout


def test_importing_aiak_and_model_spec_loads_no_model_library():
    code = ("import sys, aiak, aiak.cli.model_spec; "
            "print(sorted(m for m in ('timm', 'torchvision', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_compute_loss_is_cross_entropy_on_the_class_scores():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 1, 0])
    assert torch.equal(compute_loss(model, (x, y)), nn.functional.cross_entropy(model(x), y))

    class Tupled(nn.Module):  # torchvision's Inception in training mode: (logits, aux_logits)
        def forward(self, input_ids, attention_mask):
            return model(input_ids * attention_mask), None

    batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y}
    assert torch.equal(compute_loss(Tupled(), batch), nn.functional.cross_entropy(model(x), y))
