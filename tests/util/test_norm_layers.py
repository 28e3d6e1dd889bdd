"""One answer to "is this a normalization layer?" for O2, LAMB/LARS and the probes, on the norm layers users'
models really hold (torch's, timm's, Hugging Face's, a custom one)."""
import pytest
import torch
from torch import nn

import aiak
from aiak.optim.param_groups import excluded_parameters
from aiak.strategy.probes import module_counts
from aiak.util.norm_layers import is_norm_layer, norm_kind


class MyRMSNorm(nn.Module):
    """A user's own norm layer, subclassing nothing of torch's."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        self.seen = x.dtype
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def _norms():
    from timm.layers import LayerNorm2d
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return {"torch LayerNorm": (nn.LayerNorm(8), "layernorm"), "torch BatchNorm1d": (nn.BatchNorm1d(8), "batchnorm"),
            "torch GroupNorm": (nn.GroupNorm(2, 8), "groupnorm"), "timm LayerNorm2d": (LayerNorm2d(8), "layernorm"),
            "HF LlamaRMSNorm": (LlamaRMSNorm(8), "norm"), "custom MyRMSNorm": (MyRMSNorm(8), "norm")}


@pytest.mark.parametrize("name", list(_norms()))
def test_o2_lamb_and_the_probes_agree_on_each_norm_layer(name):
    norm, kind = _norms()[name]
    model = nn.Sequential(nn.Linear(8, 8), norm)
    assert is_norm_layer(norm) and norm_kind(norm) == kind
    assert {id(p) for p in norm.parameters()} <= excluded_parameters(model)        # LAMB/LARS leave it out
    counts = module_counts(model)                                                 # the probes' module kinds
    expected = {k: int(k == kind) for k in ("batchnorm", "layernorm", "groupnorm")}
    assert {k: counts[k] for k in expected} == expected


def test_o2_computes_a_custom_norm_layer_in_fp32():
    """O2 runs the Linear in bf16 and the user's own RMSNorm in fp32, as it does torch's norm layers."""
    model = nn.Sequential(nn.Linear(8, 8), MyRMSNorm(8))
    model, _, _ = aiak.optimize(model, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    model(torch.randn(2, 8))
    assert model[1].seen == torch.float32


def test_a_head_named_after_a_norm_is_not_mistaken_for_one_by_lamb():
    """A module that holds others is not a norm layer by its name: only what its own rules exclude is."""
    class NormHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

    head = NormHead()
    assert not is_norm_layer(head) and excluded_parameters(head) == {id(head.fc.bias)}
    assert not is_norm_layer(nn.Linear(2, 2)) and norm_kind(nn.Conv2d(1, 1, 1)) is None


def _blocks_named_after_norms():
    import timm
    import torchvision
    from timm.layers import ConvNormAct

    return {"timm ConvNormAct": ConvNormAct(3, 8, 3),
            "torchvision Conv2dNormActivation": torchvision.ops.Conv2dNormActivation(3, 8, 3),
            "timm NormFreeNet": timm.create_model("nf_resnet26", num_classes=4)}


@pytest.mark.parametrize("name", list(_blocks_named_after_norms()))
def test_a_block_named_after_a_norm_computes_its_convolutions_in_half_under_o2(name):
    """Blocks whose class names say ``Norm`` but hold convolutions: not norm layers, so O2 computes their
    convolutions in bf16 (taken for norm layers, they ran wholly in fp32, and timm's NormFreeNet got no O2 at
    all)."""
    block = _blocks_named_after_norms()[name]
    assert not is_norm_layer(block)
    convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
    seen = []
    for conv in convs:
        conv.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    block, _, _ = aiak.optimize(block, strategy={"precision": {"level": "O2", "dtype": "bf16"}})
    with torch.no_grad():
        block(torch.randn(2, 3, 32, 32))
    assert seen and all(dtype == torch.bfloat16 for dtype in seen), seen
