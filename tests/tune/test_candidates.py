"""Which candidates the trials propose (`aiak.tune.candidates.candidate_strategies`)."""
import pytest

from aiak.cli.demo import DemoNet
from aiak.strategy.probes import probe
from aiak.strategy.schema import Strategy
from aiak.tune.candidates import candidate_strategies

timm = pytest.importorskip("timm")

PICK = Strategy.from_dict({"extends": "default", "precision": {"level": "O1", "dtype": "bf16"}}, source="<test>")


def labels(model, pick=PICK):
    return [c.label for c in candidate_strategies(pick, probe(model), limit=8, max_seconds=None)]


def test_channels_last_is_proposed_for_a_convolutional_net():
    assert "channels_last=true" in labels(DemoNet(width=8))


@pytest.mark.parametrize("make", [
    lambda: timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10),
    lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, embed_dim=48,
                              depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16), num_classes=10)], ids=["vit", "swin"])
def test_not_for_a_transformer_whose_only_convolution_is_its_patch_embedding(make):
    """Laid out NHWC, one strided convolution gains nothing and costs the trials a gradient and the run's first
    steps the guard's windows of one more arm (ViT-Tiny: 0.91x plain in those windows, as the pick's 0.90x)."""
    model = make()
    assert probe(model).modules["conv2d"] == 1
    assert not any(label.startswith("channels_last") for label in labels(model))


def test_a_pick_with_channels_last_gets_the_variant_without_it_on_any_convolution():
    """Where the pick has channels_last (a rule, or the user's strategy), the variant without it is timed, one Conv2d
    or many: it may be the faster."""
    one_conv = timm.create_model("vit_tiny_patch16_224", img_size=64, num_classes=10)
    pick = Strategy.from_dict({"extends": "default", "channels_last": True,
                               "precision": {"level": "O1", "dtype": "bf16"}}, source="<test>")
    assert "channels_last=false" in labels(one_conv, pick)


def test_the_neutral_candidate_keeps_the_1x1_convolutions_as_matrix_multiplies():
    """`pointwise_conv` computes the same products with another kernel (`aiak.ops.surgery.NEUTRAL_FUSED_OPS`): the
    pick's numerics-neutral subset keeps it beside the layout and leaves the gated window attention out, so the
    neutral candidate is timed with the kernel that makes a bottleneck ResNet fast on a CPU, without the gate."""
    from aiak.tune.gate import is_neutral

    pick = Strategy.from_dict({"extends": "default", "channels_last": True, "precision": {"level": "O1", "dtype": "bf16"},
                               "fused_ops": ["window_attention", "pointwise_conv"]}, source="<test>")
    candidates = {c.label: c for c in candidate_strategies(pick, probe(timm.create_model("resnet26", num_classes=10)),
                                                            limit=8, max_seconds=None)}
    neutral = candidates["neutral"]
    assert neutral.changes.get("fused_ops") == ["pointwise_conv"] and neutral.changes.get("channels_last") is True
    assert neutral.neutral and "precision.level" not in neutral.changes
    assert is_neutral({"fused_ops": ["pointwise_conv"]}) and not is_neutral({"fused_ops": ["window_attention"]})
    assert not is_neutral({"fused_ops": ["pointwise_conv", "linear_cross_entropy"]})
    assert not is_neutral(["fused_ops"])   # a key without its value: its ops unknown, gated
