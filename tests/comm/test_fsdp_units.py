"""The sharding units ``comm.engine: fsdp2`` finds by structure in real models (`aiak.comm.fsdp.sharding_units`),
and the class names that override them."""
import pytest
from torch import nn

from aiak.comm.fsdp import sharding_units


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=50))


def _timm(name):
    import timm

    return lambda: timm.create_model(name, pretrained=False)


def _torchvision(name):
    def make():
        import torchvision

        return getattr(torchvision.models, name)()
    return make


@pytest.mark.parametrize("make, count, unit", [
    (_gpt2, 3, "GPT2Block"),                                   # a Hugging Face model's _no_split_modules
    (_timm("vit_tiny_patch16_224"), 12, "Block"),
    (_timm("swin_tiny_patch4_window7_224"), 12, "SwinTransformerBlock"),  # the blocks, not the 4 stages around them
    (_timm("convnext_atto"), 12, "ConvNeXtBlock"),
    (_torchvision("resnet18"), 8, "BasicBlock"),                # blocks held as attributes layer1..layer4
    (_torchvision("swin_t"), 12, "SwinTransformerBlock"),
], ids=["hf-gpt2", "timm-vit", "timm-swin", "timm-convnext", "tv-resnet18", "tv-swin_t"])
def test_units_are_the_models_blocks(make, count, unit):
    units = sharding_units(make())
    assert len(units) == count and {type(u).__name__ for u in units} == {unit}


def test_class_names_override_the_structure_and_a_lone_layer_is_no_block():
    """Given class names win (the outermost where they nest); a Sequential of bare layers is no unit: each child
    must be a block of two or more layers holding parameters."""
    import torchvision

    resnet = torchvision.models.resnet18()
    assert [type(u).__name__ for u in sharding_units(resnet, ["Sequential"])] == ["Sequential"] * 4
    assert sharding_units(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))) == []
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(3)))
    assert sharding_units(blocks) == list(blocks)
    assert sharding_units(nn.Linear(2, 2)) == []
