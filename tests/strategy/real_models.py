"""Real third-party models at small sizes (random weights, nothing downloaded), shared by the strategy tests.

timm, torchvision and transformers come with the test extra, so they are imported unconditionally: a missing
library is a failure, not a skip.
"""
import timm
import torchvision
import transformers
from torch import nn


def timm_swin():
    return timm.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, num_classes=10)


def torchvision_swin():
    return torchvision.models.swin_t(num_classes=10)


def hf_swin():
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                     window_size=4, num_labels=10)
    return transformers.SwinForImageClassification(config)


def hf_bert():
    return transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=100))


def timm_resnet18():
    return timm.create_model("resnet18", num_classes=10)


def torchvision_resnet18():
    return torchvision.models.resnet18(num_classes=10)


def encoder():
    """A plain torch transformer encoder (nn.MultiheadAttention + nn.LayerNorm)."""
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
