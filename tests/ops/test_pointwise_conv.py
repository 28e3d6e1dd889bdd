"""aiak.ops.pointwise_conv: 1x1 convolutions computed as ``F.linear`` over the channels, on real modules and models.

The swapped forward must compute what ``nn.Conv2d`` computes (output, input/weight/bias gradients, output memory
format), swap exactly the plain 1x1 convolutions, and keep everything a training script relies on working (hooks,
``state_dict``, copies, pickling, EMA, weight norm, checkpointing, LoRA, ``torch.compile``).

timm, torchvision and transformers classes are the real ones with random weights (nothing is downloaded). Every
normalisation layer's affine parameters and running statistics are randomised first: timm's ResNets start with the
last BatchNorm of each block at zero (``zero_init_last``), which would make every ``conv3`` unobservable.

Tolerances:

* single modules in fp32: ``rtol=1e-4, atol=1e-5`` (values and gradients are O(1) sums of at most a few hundred
  products; another summation order moves them by ~1e-6).
* whole networks in training mode are compared in float64: BatchNorm in training mode at the 1x1 maps of the last
  stage divides by the standard deviation of as many numbers as the batch has images, which amplifies the fp32
  rounding of earlier layers by orders of magnitude (measured in fp32: 0.4 relative output difference for
  torchvision's ResNet-50 at batch 2; gradients off by up to 4e-2 of the largest gradient for regnety_002 at
  batch 4). In float64 at batch 4 the largest differences measured were 8e-12 (logits, relative to the largest
  logit) and 4e-11 (gradients, relative to the model's largest gradient), both regnety_002: ``rtol=1e-7`` and
  ``atol=1e-7`` times that largest magnitude leave a margin of >1000x, while a wrong channel map, stride or bias is
  an O(1) error and a weight off by 1e-3 fails every architecture. The atol is model-wide because gradients that
  are zero in exact arithmetic (a BatchNorm bias followed by another BatchNorm) are pure rounding noise.
* whole networks in eval mode in fp32: ``rtol=1e-4, atol=1e-5 * max|out|`` (BatchNorm is affine there).
* bf16 autocast: every layer rounds its output to bf16 (2**-8 relative), and a different accumulation order flips
  some roundings that then compound through the depth: ``rtol=atol/max|out|=5e-2``.
"""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

from aiak.ops.pointwise_conv import (PointwiseConvAsMatmul, is_pointwise_conv, pointwise_convs,
                                     replace_pointwise_convs, restore_pointwise_convs)

REPO = Path(__file__).resolve().parents[2]
CL = torch.channels_last
FP32 = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the suite runs two xdist workers on this project's 2-core machine, and with two OpenMP
    threads each the thousands of tiny per-channel float64 convolutions of a depthwise network (no oneDNN kernel
    for float64: one call per group) wait on descheduled threads. Measured under that load: efficientnet_b0's
    float64 forward+backward took 12.5 s with two threads, 0.18 s with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Calls(TorchFunctionMode):
    """Records the torch functions called inside it (``linear``, ``conv2d``, ...): which forward actually ran."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _calls(module, *args):
    with torch.no_grad(), _Calls() as calls:
        module(*args)
    return calls.names


def _layout(t):
    return t.is_contiguous(), t.is_contiguous(memory_format=CL), t.stride()


def _swapped_copy(module):
    swapped = copy.deepcopy(module)
    replace_pointwise_convs(swapped)
    return swapped


def _small_cnn(classes=5):
    """A Sequential (so that a whole pickled model loads in another process) with three pointwise convolutions:
    one strided with a bias, one on a 1x1 map (squeeze-excite style) and one plain."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
        nn.Conv2d(8, 24, 1, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Conv2d(24, 12, 1), nn.Flatten(), nn.Linear(12, classes))


SMALL_CNN_POINTWISE = ["3", "8", "11"]


# --------------------------------------------------------------------------- 1. equivalence with nn.Conv2d

def _contiguous(shape):
    return torch.randn(shape), lambda t: t


def _channels_last(shape):
    return torch.randn(shape).to(memory_format=CL), lambda t: t


def _slice_of_contiguous(shape):
    n, c, h, w = shape
    return torch.randn(n, c, h, w + 1), lambda t: t[..., 1:]


def _channel_slice_of_contiguous(shape):
    n, c, h, w = shape
    return torch.randn(n, c + 3, h, w), lambda t: t[:, 1:c + 1]


def _every_other_pixel_of_contiguous(shape):
    n, c, h, w = shape
    return torch.randn(n, c, 2 * h, 2 * w), lambda t: t[:, :, ::2, ::2]


def _channel_slice_of_channels_last(shape):
    """What ``x.chunk(2, dim=1)`` of a channels_last tensor gives (ShuffleNet's channel split, CSP blocks)."""
    n, c, h, w = shape
    return torch.randn(n, c + 3, h, w).to(memory_format=CL), lambda t: t[:, 1:c + 1]


def _spatial_slice_of_channels_last(shape):
    n, c, h, w = shape
    return torch.randn(n, c, h, w + 1).to(memory_format=CL), lambda t: t[..., 1:]


LAYOUTS = [_contiguous, _channels_last, _slice_of_contiguous, _channel_slice_of_contiguous,
           _every_other_pixel_of_contiguous, _channel_slice_of_channels_last, _spatial_slice_of_channels_last,
           "channels_last_weight"]
LAYOUT_IDS = [f.__name__.lstrip("_") if callable(f) else f for f in LAYOUTS]
STRIDES = [1, 2, (2, 1)]


def _conv_and_input(stride, bias, layout):
    """An ``nn.Conv2d(8, 6, 1)`` and its swapped copy, and an input leaf (what gradients are taken of) with the
    view of it the convolution sees. ``channels_last_weight``: ``model.to(memory_format=channels_last)`` with a
    contiguous input."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 1, stride=stride, bias=bias)
    if layout == "channels_last_weight":
        conv = conv.to(memory_format=CL)
        layout = _contiguous
    swapped = copy.deepcopy(conv)
    assert replace_pointwise_convs(swapped) == 1
    leaf, view = layout((3, 8, 7, 10))
    return conv, swapped, leaf, view


def _forward_backward(module, leaf, view):
    leaf = leaf.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(view(leaf))
    # a loss whose gradient differs per element, so that a permuted or misplaced gradient shows
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out, leaf.grad, module.weight.grad, None if module.bias is None else module.bias.grad


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("stride", STRIDES, ids=["s1", "s2", "s2x1"])
def test_matches_conv2d_output_and_gradients(stride, bias, layout):
    """Output and the input, weight and bias gradients equal nn.Conv2d's (fp32 tolerance, see the module
    docstring); fails if the stride, the channel map, the bias or the gradient routing of the matmul were wrong.
    The swapped forward ran (F.linear, no conv2d), so the comparison is not conv against conv."""
    conv, swapped, leaf, view = _conv_and_input(stride, bias, layout)
    expected = _forward_backward(conv, leaf, view)
    got = _forward_backward(swapped, leaf, view)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), got, expected):
        if b is None:
            assert a is None, name
        else:
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    names = _calls(swapped, view(leaf))
    assert "linear" in names and "conv2d" not in names, names


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("stride", STRIDES, ids=["s1", "s2", "s2x1"])
def test_output_memory_format_matches_conv2d(stride, layout):
    """The output is channels_last exactly where the convolution's is (the module docstring's promise: the next
    layers, and a channels_last training run, keep the layout they had). Compared as (is_contiguous,
    is_contiguous(channels_last), strides)."""
    conv, swapped, leaf, view = _conv_and_input(stride, True, layout)
    with torch.no_grad():
        expected, got = conv(view(leaf)), swapped(view(leaf))
    assert _layout(got) == _layout(expected)


@pytest.mark.parametrize("kwargs", [dict(padding="valid"), dict(padding="same"), dict(padding="valid", stride=2),
                                    dict(padding=0, padding_mode="reflect"),
                                    dict(padding="same", padding_mode="circular"),
                                    dict(dilation=2), dict(dilation=2, stride=2)],
                         ids=["valid", "same", "valid-s2", "reflect-0", "same-circular", "dilation2", "dilation2-s2"])
def test_string_padding_padding_modes_and_dilation_are_swapped_and_match(kwargs):
    """padding='valid'/'same' with a 1x1 kernel pad nothing, a padding mode with zero padding pads nothing, and a
    dilation spreads a single tap over nothing: all are pointwise and must be swapped and compute as the conv."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 1, **kwargs)
    assert is_pointwise_conv(conv)
    swapped = _swapped_copy(conv)
    assert pointwise_convs(swapped) == [swapped]
    leaf, view = _contiguous((2, 8, 7, 9))
    for a, b in zip(_forward_backward(swapped, leaf, view), _forward_backward(conv, leaf, view)):
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("stride", [1, 2], ids=["s1", "s2"])
def test_unbatched_input_computes_as_the_convolution(stride):
    """An unbatched [C, H, W] input is accepted by nn.Conv2d: the swapped module must give the same [O, H', W']
    result and gradients (it must not treat C as the batch)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 1, stride=stride)
    swapped = _swapped_copy(conv)
    leaf, view = _contiguous((8, 7, 9))
    expected, got = _forward_backward(conv, leaf, view), _forward_backward(swapped, leaf, view)
    assert got[0].shape == expected[0].shape == (6, 4 if stride == 2 else 7, 5 if stride == 2 else 9)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **FP32)


# ----------------------------------------------------------------------------------- 2. what is swapped

class _OwnConvForward(nn.Conv2d):
    """A 1x1 convolution whose ``_conv_forward`` does something else than a plain convolution."""

    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight - weight.mean(), bias)


class _OwnForward(nn.Conv2d):
    def forward(self, input):
        return super().forward(input) * 2


class _Tagged(nn.Conv2d):
    """A subclass that only adds an attribute: it computes as nn.Conv2d, so it is swapped."""

    tag = "mine"


LEFT_ALONE = {
    "kernel3": lambda: nn.Conv2d(8, 6, 3),
    "kernel3-padded": lambda: nn.Conv2d(8, 6, 3, padding=1),
    "kernel1x3": lambda: nn.Conv2d(8, 6, (1, 3)),
    "depthwise-1x1": lambda: nn.Conv2d(8, 8, 1, groups=8),
    "groups2-1x1": lambda: nn.Conv2d(8, 6, 1, groups=2),
    "padding1-1x1": lambda: nn.Conv2d(8, 6, 1, padding=1),
    "timm-ScaledStdConv2d": lambda: timm.layers.ScaledStdConv2d(8, 6, 1),
    "timm-Conv2dSame": lambda: timm.layers.Conv2dSame(8, 6, 1),
    "own-_conv_forward": lambda: _OwnConvForward(8, 6, 1),
    "own-forward": lambda: _OwnForward(8, 6, 1),
    "conv1d-1": lambda: nn.Conv1d(8, 6, 1),
    "conv3d-1": lambda: nn.Conv3d(8, 6, 1),
    "linear": lambda: nn.Linear(8, 6),
}


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_modules_that_are_not_plain_pointwise_convs_are_left_alone(name):
    """A kernel larger than 1, groups > 1, padding (which adds border pixels a matmul would not produce), and
    subclasses that override forward or _conv_forward (weight standardisation, dynamic 'same' padding) compute
    something else than W x + b per pixel: swapping them would silently change the model."""
    torch.manual_seed(0)
    module = LEFT_ALONE[name]()
    cls = type(module)
    assert not is_pointwise_conv(module)
    assert replace_pointwise_convs(nn.Sequential(module)) == 0
    assert type(module) is cls and not isinstance(module, PointwiseConvAsMatmul)


def test_subclass_that_keeps_conv2d_forward_is_swapped_and_stays_an_instance_of_its_class():
    """A subclass that does not change how it computes is a plain 1x1 conv: it is swapped, and isinstance checks
    against it and nn.Conv2d (which scripts, timm and peft make) still hold."""
    module = _Tagged(8, 6, 1)
    assert replace_pointwise_convs(module) == 1
    assert isinstance(module, _Tagged) and isinstance(module, nn.Conv2d) and module.tag == "mine"
    assert "linear" in _calls(module, torch.randn(2, 8, 3, 3))


def test_replace_twice_restore_and_replace_again():
    """Counts are of modules swapped now (0 the second time); parameters stay the same objects (an optimizer
    built before keeps stepping them); restore gives back the original classes with their conv forward."""
    model = _small_cnn()
    params = [id(p) for p in model.parameters()]
    classes = [type(m) for m in model.modules()]
    assert replace_pointwise_convs(model) == 3
    assert [n for n, m in model.named_modules() if m in pointwise_convs(model)] == SMALL_CNN_POINTWISE
    assert all(isinstance(model[int(n)], nn.Conv2d) and is_pointwise_conv(model[int(n)]) for n in SMALL_CNN_POINTWISE)
    assert type(model[3]).__name__ == "MatmulConv2d"
    assert replace_pointwise_convs(model) == 0
    assert [id(p) for p in model.parameters()] == params
    assert _calls(model, torch.randn(2, 3, 8, 8)).count("conv2d") == 2  # the 3x3 stem and the depthwise conv

    assert restore_pointwise_convs(model) == 3
    assert [type(m) for m in model.modules()] == classes and pointwise_convs(model) == []
    assert _calls(model, torch.randn(2, 3, 8, 8)).count("conv2d") == 5
    assert restore_pointwise_convs(model) == 0
    assert replace_pointwise_convs(model) == 3


def test_lazy_conv2d_swap_count_stays_true_after_its_first_call():
    """The count replace_pointwise_convs returns for an uninitialised nn.LazyConv2d(k=1) (what fused_ops reports)
    must still describe the module after the first call materialises it (whether lazy modules are swapped or left
    alone is the op's choice; saying one and doing the other is not)."""
    lazy = nn.LazyConv2d(6, 1)
    count = replace_pointwise_convs(lazy)
    lazy(torch.randn(2, 8, 5, 5))
    assert len(pointwise_convs(lazy)) == count, type(lazy)


def test_lazy_conv2d_swapped_accepts_an_unbatched_first_call():
    """An unbatched first call to a swapped nn.LazyConv2d must compute as the lazy convolution does."""
    torch.manual_seed(0)
    reference = nn.LazyConv2d(6, 1)
    lazy = copy.deepcopy(reference)
    replace_pointwise_convs(lazy)
    x = torch.randn(8, 5, 5)
    torch.manual_seed(1)
    expected = reference(x)
    torch.manual_seed(1)
    torch.testing.assert_close(lazy(x), expected, **FP32)


# ------------------------------------------------------------------------------- 3. real architectures

def _randomize_norms(model):
    """Random affine parameters and running statistics for every norm layer: timm's ResNets zero the last BN of a
    block (its 1x1 conv3 would be unobservable), and identity statistics would hide an eval-mode mismatch."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)):
                if getattr(m, "weight", None) is not None:
                    m.weight.uniform_(0.5, 1.5, generator=g)
                    m.bias.normal_(0, 0.2, generator=g)
                if getattr(m, "running_mean", None) is not None:
                    m.running_mean.normal_(0, 0.2, generator=g)
                    m.running_var.uniform_(0.5, 1.5, generator=g)
    return model


def _conv_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]


def _resnet50_pointwise():
    """Bottleneck ResNet-50 (3, 4, 6, 3 blocks): conv1 and conv3 of every block, downsample.0 of each stage's
    first block: 2 * 16 + 4 = 36 (the stem is 7x7, conv2 3x3)."""
    names = [f"layer{s}.{b}.conv{c}" for s, n in zip(range(1, 5), (3, 4, 6, 3)) for b in range(n) for c in (1, 3)]
    return sorted(names + [f"layer{s}.0.downsample.0" for s in range(1, 5)])


def _all_but(model, *suffixes):
    return sorted(n for n in _conv_names(model) if not n.endswith(suffixes))


def _hf_resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 2, 1],
                                       layer_type="bottleneck", num_labels=5, downsample_in_bottleneck=True)
    return transformers.ResNetForImageClassification(config)


def _small_densenet():
    """torchvision's DenseNet class (densenet121's code) with 2 layers per block: a 1x1 conv1 in each dense layer,
    whose input is the concatenation of all earlier features, and a 1x1 conv in each transition."""
    return torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2, 2), num_init_features=16, num_classes=5)


# name: (builder, expected swapped names given the model, expected count)
ARCHITECTURES = {
    "timm-resnet50": (lambda: timm.create_model("resnet50", pretrained=False, num_classes=5),
                      lambda m: _resnet50_pointwise(), 36),
    # MobileNetV3 / EfficientNet: every conv but the stem and the depthwise ones is 1x1 (conv_pw, conv_pwl, the
    # squeeze-excite conv_reduce / conv_expand on 1x1 maps with biases, conv_head; the last ConvBnAct stage).
    "timm-mobilenetv3_small_050": (lambda: timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5),
                                   lambda m: _all_but(m, "conv_stem", "conv_dw"), 41),
    "timm-efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", pretrained=False, num_classes=5),
                             lambda m: _all_but(m, "conv_stem", "conv_dw"), 64),
    # RegNetY: conv1, conv3, se.fc1, se.fc2 of 13 blocks and 4 downsamples; the stem and grouped conv2 are 3x3.
    "timm-regnety_002": (lambda: timm.create_model("regnety_002", pretrained=False, num_classes=5),
                         lambda m: _all_but(m, "stem.conv", "conv2.conv"), 56),
    "torchvision-resnet50": (lambda: torchvision.models.resnet50(weights=None, num_classes=5),
                             lambda m: _resnet50_pointwise(), 36),
    "torchvision-densenet": (_small_densenet, lambda m: _all_but(m, "conv0", "conv2"), 8),
    # HF bottleneck ResNet: layer.0 (1x1, stride 2 in the first block of stages 2-3: downsample_in_bottleneck),
    # layer.2 (1x1), the shortcut convolutions; the embedder is 7x7 and layer.1 3x3.
    "transformers-ResNet": (_hf_resnet, lambda m: _all_but(m, "embedder.convolution", "layer.1.convolution"), 10),
}


def _logits(out):
    return getattr(out, "logits", out)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _build(name):
    builder, expected_names, expected_count = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = _randomize_norms(builder())
    swapped = copy.deepcopy(model)
    count = replace_pointwise_convs(swapped)
    names = sorted(n for n, m in swapped.named_modules() if isinstance(m, PointwiseConvAsMatmul))
    assert names == expected_names(model)
    assert count == expected_count == len(names)
    assert all(isinstance(m, nn.Conv2d) for m in pointwise_convs(swapped))
    return model, swapped


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_real_architecture_trains_and_infers_as_the_original(name):
    """Swaps exactly the model's 1x1 convolutions (names checked against the architecture), then, on the same
    input: training-mode forward and backward (float64, see the module docstring) give the same loss, logits and
    gradient of every parameter; eval under inference_mode (fp32) gives the same logits; bf16 autocast gives the
    same dtype and logits within bf16 tolerance. Fails if any swapped layer computes something else."""
    model, swapped = _build(name)
    torch.manual_seed(0)
    x, target = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.randint(0, 5, (4,))

    results = []
    for m in (copy.deepcopy(model).double().train(), copy.deepcopy(swapped).double().train()):
        torch.manual_seed(2)  # same dropout / drop-path draws, if any
        out = _logits(m(x))
        loss = F.cross_entropy(out, target)
        loss.backward()
        results.append((loss, out, _grads(m)))
    (loss0, out0, g0), (loss1, out1, g1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-7, atol=1e-7 * loss0.abs().item())
    torch.testing.assert_close(out1, out0, rtol=1e-7, atol=1e-7 * out0.abs().max().item())
    assert g1.keys() == g0.keys()
    scale = max(g.abs().max().item() for g in g0.values())
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-7, atol=1e-7 * scale,
                                   msg=lambda m, key=key: f"{key}: {m}")

    xf = x[:2].float()
    with torch.inference_mode():
        expected, got = _logits(model.eval()(xf)), _logits(swapped.eval()(xf))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, got = _logits(model(xf)), _logits(swapped(xf))
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-2 * expected.abs().max().item())


def test_torchvision_densenet121_swaps_the_conv1_of_its_58_dense_layers_and_its_3_transitions():
    """The full densenet121 (the numerical check above runs its code at 2 layers per block): exactly the 1x1
    conv1 of each of its 6 + 12 + 24 + 16 dense layers and the 1x1 conv of its 3 transitions are swapped."""
    model = torchvision.models.densenet121(weights=None)
    assert replace_pointwise_convs(model) == 61
    assert sorted(n for n, m in model.named_modules() if m in pointwise_convs(model)) == _all_but(model, "conv0",
                                                                                                  "conv2")
    assert sum(n.endswith(".conv1") for n in _all_but(model, "conv0", "conv2")) == 58


@pytest.mark.parametrize("name", ["transformers-ResNet", "torchvision-shufflenet_v2_x0_5"])
def test_channels_last_model_keeps_every_conv_output_layout(name):
    """A model trained in channels_last: every convolution's output has the same layout with the swap as without
    (a contiguous output in the middle would switch every later layer out of channels_last). ShuffleNetV2 splits
    channels with x.chunk(2, dim=1) before its 1x1 convolutions, so they see channel slices of channels_last
    tensors."""
    torch.manual_seed(0)
    if name == "transformers-ResNet":
        model = _randomize_norms(_hf_resnet())
    else:
        model = _randomize_norms(torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=5))
    model = model.to(memory_format=CL).eval()
    swapped = _swapped_copy(model)
    x = torch.randn(2, 3, 32, 32).to(memory_format=CL)
    layouts = []
    for m in (model, swapped):
        seen = {}
        for n, conv in m.named_modules():
            if isinstance(conv, nn.Conv2d):
                conv.register_forward_hook(lambda mod, args, out, n=n, seen=seen: seen.__setitem__(n, _layout(out)))
        with torch.no_grad():
            layouts.append((seen, _logits(m(x))))
    (expected, out0), (got, out1) = layouts
    torch.testing.assert_close(out1, out0, rtol=1e-4, atol=1e-5 * out0.abs().max().item())
    assert {n: (v, expected[n]) for n, v in got.items() if v != expected[n]} == {}  # name: (swapped, conv)


# ----------------------------------------------------------------------------- 4. what scripts do with it

def test_hooks_fire_with_the_same_tensors():
    """Forward pre-hooks, forward hooks and full backward hooks registered on a conv (before the swap) fire on
    the swapped conv with the tensors the original's hooks saw: module hooks are how profilers, activation
    statistics and gradient capture see a layer, so the swap must go through Module.__call__ unchanged."""
    original = _small_cnn()
    swapped = copy.deepcopy(original)
    records = []
    for model in (original, swapped):
        seen = {}
        conv = model[8]  # stride-2 pointwise conv with a bias
        conv.register_forward_pre_hook(lambda m, args, seen=seen: seen.__setitem__("pre", args[0].detach().clone()))
        conv.register_forward_hook(lambda m, args, out, seen=seen: seen.__setitem__("out", out.detach().clone()))
        conv.register_full_backward_hook(
            lambda m, gin, gout, seen=seen: seen.update(grad_in=gin[0].clone(), grad_out=gout[0].clone()))
        records.append(seen)
    assert replace_pointwise_convs(swapped) == 3
    x = torch.randn(2, 3, 16, 16)
    for model in (original, swapped):
        model(x).pow(2).sum().backward()
    expected, got = records
    assert got.keys() == expected.keys() == {"pre", "out", "grad_in", "grad_out"}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")


def test_state_dict_is_unchanged_and_loads_both_ways():
    """Same state_dict keys and tensors as the unswapped model; a checkpoint of either loads into the other
    (a run resumed with or without fused_ops)."""
    original = _small_cnn()
    swapped = _swapped_copy(original)
    sd, sd_swapped = original.state_dict(), swapped.state_dict()
    assert list(sd_swapped) == list(sd)
    for key in sd:
        torch.testing.assert_close(sd_swapped[key], sd[key], rtol=0, atol=0)

    x = torch.randn(2, 3, 16, 16)
    plain = _small_cnn()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)  # differs from original until loaded
        plain.load_state_dict(sd_swapped)
        torch.testing.assert_close(plain.eval()(x), original.eval()(x), **FP32)
        other = _swapped_copy(plain)
        for p in other.parameters():
            p.mul_(-1.0)
        other.load_state_dict(sd)
        assert len(pointwise_convs(other)) == 3
        torch.testing.assert_close(other.eval()(x), original(x), **FP32)


def test_deepcopy_keeps_the_swap_and_computes_the_same():
    """copy.deepcopy (EMA, AveragedModel, best-model snapshots) keeps the swapped classes and their forward."""
    original = _small_cnn().eval()
    swapped = _swapped_copy(original)
    twin = copy.deepcopy(swapped)
    assert [type(m) for m in twin.modules()] == [type(m) for m in swapped.modules()]
    x = torch.randn(2, 3, 16, 16)
    names = _calls(twin, x)
    assert names.count("linear") == 4 and names.count("conv2d") == 2, names  # 3 pointwise + the head
    with torch.no_grad():
        torch.testing.assert_close(twin(x), original(x), **FP32)


@pytest.mark.slow
def test_whole_swapped_model_pickles_into_a_fresh_process(tmp_path):
    """torch.save(model) of a swapped model loads (weights_only=False) in a process that never imported
    aiak.ops.pointwise_conv, computes swapped and gives the same output."""
    model = _swapped_copy(_small_cnn()).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.save({"model": model, "x": x, "y": model(x)}, tmp_path / "model.pt")
    code = ("import sys, torch\n"
            f"saved = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
            "m = saved['model']\n"
            "from aiak.ops.pointwise_conv import PointwiseConvAsMatmul\n"
            "assert [i for i, c in enumerate(m) if isinstance(c, PointwiseConvAsMatmul)] == [3, 8, 11]\n"
            "assert type(m[3]).__name__ == 'MatmulConv2d' and isinstance(m[3], torch.nn.Conv2d)\n"
            "with torch.no_grad():\n"
            "    torch.testing.assert_close(m(saved['x']), saved['y'], rtol=1e-4, atol=1e-5)\n"
            "print('OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]


def _train_steps(model, x, target, steps=2, lr=0.1):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), target).backward()
        opt.step()


@pytest.mark.parametrize("averager", ["timm-ModelEmaV3", "torch-AveragedModel"])
def test_ema_and_averaged_model_of_a_swapped_model(averager):
    """An EMA / SWA average of a swapped model holds swapped copies, updates from the live model and forwards like
    the average of the unswapped model (same parameters after the same updates, same eval output)."""
    x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    results = []
    for swap in (False, True):
        model = _small_cnn()
        if swap:
            replace_pointwise_convs(model)
        if averager == "timm-ModelEmaV3":
            avg = timm.utils.ModelEmaV3(model, decay=0.5)
            update, inner = (lambda a=avg, m=model: a.update(m)), avg.module
        else:
            avg = torch.optim.swa_utils.AveragedModel(model)
            update, inner = (lambda a=avg, m=model: a.update_parameters(m)), avg.module
        assert len(pointwise_convs(inner)) == (3 if swap else 0)
        for _ in range(2):
            _train_steps(model, x, target, steps=1)
            update()
        with torch.no_grad():
            results.append((avg.eval()(x), [p.detach().clone() for p in inner.parameters()]))
    (expected, p0), (got, p1) = results
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b, **FP32)
    torch.testing.assert_close(got, expected, **FP32)


def test_frozen_conv_gets_no_weight_grad_but_passes_the_input_grad():
    """requires_grad=False on a swapped conv's weight and bias (fine-tuning with frozen layers): no gradient is
    made for them, while the input still gets the convolution's gradient."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 1, stride=2).requires_grad_(False)
    swapped = _swapped_copy(conv)
    leaf, view = _contiguous((2, 8, 7, 7))
    expected, got = _forward_backward(conv, leaf, view), _forward_backward(swapped, leaf, view)
    assert got[2] is None and got[3] is None and not swapped.weight.requires_grad
    torch.testing.assert_close(got[0], expected[0], **FP32)
    torch.testing.assert_close(got[1], expected[1], **FP32)


@pytest.mark.parametrize("order", ["weight_norm-then-swap", "swap-then-weight_norm"])
def test_weight_norm_parametrization_matches(order):
    """torch.nn.utils.parametrizations.weight_norm on a 1x1 conv (before or after the swap): the swapped forward
    reads self.weight through the parametrization, so output and the gradients of its g and v equal the
    unswapped weight-normed conv's. Fails if the swap read a stale weight or broke the parametrization."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    conv = weight_norm(nn.Conv2d(8, 6, 1, stride=2))
    if order == "weight_norm-then-swap":
        swapped = _swapped_copy(conv)
    else:
        torch.manual_seed(0)
        swapped = nn.Conv2d(8, 6, 1, stride=2)
        assert replace_pointwise_convs(swapped) == 1
        swapped = weight_norm(swapped)
    assert len(pointwise_convs(swapped)) == 1
    leaf, view = _contiguous((2, 8, 7, 7))
    results = []
    for m in (conv, swapped):
        m.zero_grad(set_to_none=True)
        out = m(view(leaf))
        out.pow(2).sum().backward()
        results.append([out] + [p.grad for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **FP32)
    assert "linear" in _calls(swapped, view(leaf))


def test_restore_after_weight_norm_keeps_the_parametrization():
    """A conv swapped and then weight-normed (weight_norm applied by the script after aiak.optimize()):
    restore_pointwise_convs must give back a weight-normed nn.Conv2d that still computes, not strip the
    parametrization class (without it the module has no `weight`)."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 1)
    replace_pointwise_convs(conv)
    conv = weight_norm(conv)
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        expected = conv(x)
    assert restore_pointwise_convs(conv) == 1
    assert not isinstance(conv, PointwiseConvAsMatmul) and torch.nn.utils.parametrize.is_parametrized(conv, "weight")
    with torch.no_grad():
        torch.testing.assert_close(conv(x), expected, **FP32)


def test_gradient_checkpointing_over_a_block_with_swapped_convs():
    """torch.utils.checkpoint (use_reentrant=False) recomputes the block's forward in backward: with the swap the
    recomputation must produce the same saved tensors (else checkpoint raises) and the same gradients."""
    from torchvision.models.resnet import Bottleneck

    torch.manual_seed(0)
    block = Bottleneck(32, 16, stride=2, downsample=nn.Sequential(nn.Conv2d(32, 64, 1, stride=2, bias=False),
                                                                  nn.BatchNorm2d(64)))
    block = _randomize_norms(block)
    swapped = _swapped_copy(block)
    assert len(pointwise_convs(swapped)) == 3
    x = torch.randn(4, 32, 8, 8)
    results = []
    for m in (block, swapped):
        leaf = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(m, leaf, use_reentrant=False)
        out.pow(2).mean().backward()
        results.append((out, leaf.grad, _grads(m)))
    (out0, gx0, g0), (out1, gx1, g1) = results
    torch.testing.assert_close(out1, out0, **FP32)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-5 * gx0.abs().max().item())
    scale = max(g.abs().max().item() for g in g0.values())
    for key in g0:
        torch.testing.assert_close(g1[key], g0[key], rtol=1e-4, atol=1e-5 * scale, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("order", ["peft-then-swap", "swap-then-peft"])
def test_peft_lora_on_a_pointwise_conv_trains_as_the_unswapped_one(order):
    """peft LoRA wrapping a 1x1 Conv2d target (its base layer, lora_A and lora_B are 1x1 convs): two SGD steps
    on the adapters give the same adapter weights and outputs with the swap (applied before or after
    get_peft_model) as without."""
    peft = pytest.importorskip("peft")

    def lora(model):
        torch.manual_seed(3)  # the same adapter initialisation for both models
        config = peft.LoraConfig(target_modules=["3", "8"], r=4, lora_alpha=8, lora_dropout=0.0,
                                 init_lora_weights=False)
        return peft.get_peft_model(model, config)

    x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    results = []
    for swap in (False, True):
        model = _small_cnn()
        if swap and order == "swap-then-peft":
            assert replace_pointwise_convs(model) == 3
        model = lora(model)
        if swap and order == "peft-then-swap":
            assert replace_pointwise_convs(model) == 7  # conv 11, and base_layer, lora_A, lora_B of convs 3 and 8
        if swap:
            assert len(pointwise_convs(model)) == 7
            assert "conv2d" not in [n for n in _calls(model.base_model.model[3], torch.randn(1, 16, 4, 4))]
        _train_steps(model, x, target)
        with torch.no_grad():
            results.append((model.eval()(x), {n: p.detach().clone() for n, p in model.named_parameters()
                                               if "lora_" in n}))
    (expected, p0), (got, p1) = results
    assert p1.keys() == p0.keys() and len(p0) == 4
    for key in p0:
        torch.testing.assert_close(p1[key], p0[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(got, expected, **FP32)


def test_torchvision_feature_extraction_traces_a_swapped_model():
    """torchvision's create_feature_extractor (torch.fx symbolic tracing, also timm's FX feature extraction and
    FX-based quantization) must work on a swapped model as on the original and return the same features."""
    from torchvision.models.feature_extraction import create_feature_extractor

    model = _small_cnn().eval()
    swapped = _swapped_copy(model)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = create_feature_extractor(model, {"10": "feat"})(x)["feat"]
        got = create_feature_extractor(swapped, {"10": "feat"})(x)["feat"]
    torch.testing.assert_close(got, expected, **FP32)


# ---------------------------------------------------------------------------------------- 5. torch.compile

def test_torch_compile_has_no_more_graph_breaks_and_matches():
    """Dynamo traces the swapped forward (is_contiguous / stride branches are guards, not breaks): no more graph
    breaks than the plain model, the graphs hold linear where the pointwise convs were, and compiled (eager
    backend) outputs and gradients match the uncompiled original."""
    import torch._dynamo

    model = _small_cnn()
    swapped = _swapped_copy(model)
    x, target = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    explained = []
    for m in (model, swapped):
        torch._dynamo.reset()
        explained.append(torch._dynamo.explain(m)(x))
    plain, fused = explained
    assert fused.graph_break_count <= plain.graph_break_count, fused.break_reasons

    def count(explanation, op):
        return sum(op in str(node.target) for g in explanation.graphs for node in g.graph.nodes)

    assert count(plain, "conv2d") == 5 and count(fused, "conv2d") == 2
    assert count(fused, "linear") == count(plain, "linear") + 3

    results = []
    for m in (model, copy.deepcopy(model), swapped):
        torch._dynamo.reset()
        compiled = m if not results else torch.compile(m, backend="eager")  # uncompiled reference first
        out = compiled(x)
        F.cross_entropy(out, target).backward()
        results.append((out, _grads(m)))
    torch._dynamo.reset()
    (out0, g0), *compiled_results = results
    for out, grads in compiled_results:
        torch.testing.assert_close(out, out0, **FP32)
        for key in g0:
            torch.testing.assert_close(grads[key], g0[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")
