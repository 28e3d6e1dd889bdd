"""Model SPECs: a short string naming a model, built with random weights into a ready training setup.

``aiak explain --model SPEC`` and ``benchmarks/auto.py`` need a real model, an optimizer and a loader of
the right kind of data without the user writing a script. A SPEC is one of (a public contract):

========================  =====================================================================================
``demo``                  `aiak.cli.demo.DemoNet` (a small CNN with BatchNorm), 3x32x32 images
``timm:NAME``             ``timm.create_model(NAME, pretrained=False)``; input from its ``pretrained_cfg``
``torchvision:NAME``      ``torchvision.models.get_model(NAME, weights=None)`` (classification models), 224 px
``hf:NAME``               a transformers model *type* (``swin``, ``vit``, ``bert``, ``resnet``, ...): the
                          default config of ``CONFIG_MAPPING[NAME]`` with its ``*ForImageClassification`` or
                          ``*ForSequenceClassification`` head, built by the Auto class's ``from_config``
``path/to/file.py:fn``    imports the file and calls ``fn()``, which returns a module or ``(module, (C, H, W))``
========================  =====================================================================================

Weights are random and nothing is downloaded (never ``pretrained=True``, ``weights=...`` or
``from_pretrained``; ``HF_HUB_OFFLINE=1`` is set before transformers is imported here). timm, torchvision
and transformers are imported only inside the branch that needs them, so ``import aiak`` loads none of them.

The data is synthetic and learnable, so a loss comparison means something: an image of class ``k`` is a
fixed random pattern plus Gaussian noise (as `aiak.cli.demo.synthetic_dataset`); a text sample of class
``k`` is random tokens in which about one in five is class ``k``'s keyword, padded at the end to a fixed
length (``attention_mask`` marks the real tokens). Samples are generated from ``(seed, index)`` when read,
so a large input shape never holds the whole data set in memory.

The optimizer follows the training recipe of the model's family: AdamW(lr 5e-4, weight decay 0.05, the DeiT
recipe, Touvron et al. 2021) for transformers (any attention module, and every text model); SGD(lr 0.01,
momentum 0.9) otherwise (the ResNet recipe, He et al. 2016, at a small-batch learning rate).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from aiak.util.nested import logits_of
from aiak.util.text import did_you_mean
from aiak.util.machine.versions import install_hint

__all__ = ["ModelSpecError", "ModelSetup", "build", "from_model", "parse_input_shape", "compute_loss", "logits_of",
           "default_optimizer", "SyntheticImages", "SyntheticText", "SPEC_FORMS"]

SPEC_FORMS = "demo, timm:NAME, torchvision:NAME, hf:NAME (a transformers model type) or path/to/file.py:factory"
DEFAULT_BATCH_SIZE = {"demo": 64}          # every other family: 32 (the batch benchmarks/auto.py measures with)
DEFAULT_TEXT_LENGTH = 128                  # tokens; transformers' configs allow 512, a CPU wants fewer
BATCHES_PER_SETUP = 16                     # default ``samples`` = 16 batches: enough for warm-up and trials
_LIBRARY = {"timm": "timm", "torchvision": "torchvision", "hf": "transformers"}   # said in the description
MAX_LABELS = 10                            # labels drawn from the first min(10, outputs) classes


class ModelSpecError(ValueError):
    """A SPEC that cannot be built; the message names the SPEC and says what would be valid."""


@dataclass
class ModelSetup:
    """What a SPEC builds: the three objects ``aiak.optimize`` takes, and a line describing them.

    ``input_shape`` is ``(C, H, W)`` for images and ``(length,)`` for text; each batch of ``loader`` is
    ``(images, labels)`` for images and ``{"input_ids", "attention_mask", "labels"}`` for text (see
    `compute_loss`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    description: str
    input_shape: Tuple[int, ...]
    batch_size: int
    kind: str = "image"                    # "image" | "text"


# ------------------------------------------------------------------------------------------ data

def _sample_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


class SyntheticImages(Dataset):
    """``n`` learnable images of ``shape`` (C, H, W): class ``k`` is pattern ``k`` plus ``noise`` x N(0, 1).

    With the default noise (0.8, as `aiak.cli.demo.synthetic_dataset`) a model learns the classes within
    tens of steps; a benchmark that compares losses over a fixed number of steps raises it to keep the task
    from being solved (loss near 0 hides any difference).
    """

    def __init__(self, n: int, shape: Sequence[int], num_classes: int = MAX_LABELS, seed: int = 0,
                 noise: float = 0.8):
        g = torch.Generator().manual_seed(seed)
        self.shape, self.seed, self.noise = tuple(shape), seed, float(noise)
        self.patterns = torch.randn(num_classes, *self.shape, generator=g)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        label = self.labels[index]
        noise = torch.randn(self.shape, generator=_sample_generator(self.seed, index))
        return self.patterns[label] + self.noise * noise, label


class SyntheticText(Dataset):
    """``n`` learnable token sequences of ``length``: about 1 token in 5 is the class's keyword id.

    Each sample has a real length between ``length // 2`` and ``length`` and is padded with token 0 to
    ``length`` (``attention_mask`` 0 there), so batches have one shape, as after a tokenizer's padding.
    """

    def __init__(self, n: int, length: int, vocab_size: int, num_classes: int = 2, seed: int = 0):
        if vocab_size < num_classes + 2:
            raise ValueError(f"vocab_size {vocab_size} is too small for {num_classes} classes")
        g = torch.Generator().manual_seed(seed)
        self.length, self.vocab_size, self.seed = length, vocab_size, seed
        self.keywords = torch.randperm(vocab_size - 1, generator=g)[:num_classes] + 1   # never the pad id 0
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        g = _sample_generator(self.seed, index)
        label = self.labels[index]
        real = int(torch.randint(max(1, self.length // 2), self.length + 1, (), generator=g))
        ids = torch.randint(1, self.vocab_size, (self.length,), generator=g)
        ids = torch.where(torch.rand(self.length, generator=g) < 0.2, self.keywords[label], ids)
        mask = (torch.arange(self.length) < real).long()
        return {"input_ids": ids * mask, "attention_mask": mask, "labels": label}


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Cross-entropy of ``model`` on one batch of a `ModelSetup` loader: what a user's loop computes."""
    if isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return nn.functional.cross_entropy(logits_of(model(**inputs)).float(), batch["labels"])
    x, y = batch
    return nn.functional.cross_entropy(logits_of(model(x)).float(), y)


# ------------------------------------------------------------------------------------------ families

@dataclass
class _Built:
    model: nn.Module
    family: str                               # "demo" | "timm" | "torchvision" | "hf" | "file"
    kind: str                                 # "image" | "text"
    input_shape: Tuple[int, ...]
    vocab_size: Optional[int] = None
    note: str = ""                            # a change made so the model fits the input, said in the description


def _need(module: str, spec: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ModelSpecError(f"model {spec!r} needs {module}, which is not installed ({e}); "
                             f"install it with: {install_hint(module)}  (the torch pin keeps the torch you have; "
                             f"aiak's [test] extra includes {module})") from e


def _image_shape(shape: Optional[Tuple[int, ...]], default: Sequence[int], spec: str) -> Tuple[int, int, int]:
    shape = tuple(default) if shape is None else shape
    if len(shape) != 3:
        raise ModelSpecError(f"model {spec!r} takes images: the input shape is C,H,W (3 numbers), got "
                             f"{','.join(map(str, shape))}")
    return tuple(int(v) for v in shape)


class _NoSuchArgument(Exception):
    """The model's constructor does not take the size argument it was offered (a size-agnostic CNN)."""


def _construct(spec: str, constructor, *args, **kwargs) -> nn.Module:
    """``constructor(*args, **kwargs)``; a failure becomes one `ModelSpecError` naming the call."""
    try:
        return constructor(*args, **kwargs)
    except TypeError as e:
        offered = [k for k in ("img_size", "image_size") if k in kwargs]
        if offered and "unexpected keyword argument" in str(e) and repr(offered[0]) in str(e):
            raise _NoSuchArgument() from e
        error = e
    except Exception as e:
        error = e
    call = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    raise ModelSpecError(f"model {spec!r}: {getattr(constructor, '__qualname__', constructor)}({call}) raised "
                         f"{type(error).__name__}: {error}") from error


def _build_demo(spec: str, shape):
    from aiak.cli.demo import DemoNet

    shape = _image_shape(shape, (3, 32, 32), spec)
    if shape[0] != 3:
        raise ModelSpecError(f"model 'demo' takes 3-channel images, got input shape {','.join(map(str, shape))}")
    return _Built(DemoNet(), "demo", "image", shape)


def _build_timm(spec: str, name: str, shape):
    timm = _need("timm", spec)
    if not timm.is_model(name):
        raise ModelSpecError(f"model {spec!r}: timm has no model {name!r}{did_you_mean(name, timm.list_models())}; "
                             f"timm.list_models() lists them")
    cfg = timm.get_pretrained_cfg(name)
    default = tuple(getattr(cfg, "input_size", None) or (3, 224, 224))
    shape = _image_shape(shape, default, spec)
    kwargs = {"pretrained": False, "in_chans": shape[0]}
    if shape != default:
        kwargs["img_size"] = shape[1] if shape[1] == shape[2] else shape[1:]
    try:
        model = _construct(spec, timm.create_model, name, **kwargs)
    except _NoSuchArgument:           # a CNN: no img_size argument, it takes any size as it is
        del kwargs["img_size"]
        model = _construct(spec, timm.create_model, name, **kwargs)
    return _Built(model, "timm", "image", shape)


def _build_torchvision(spec: str, name: str, shape):
    _need("torchvision", spec)
    from torchvision import models

    classification = models.list_models(module=models)
    if name not in classification:
        other = " (a detection, segmentation, video or optical-flow model: only classification models have " \
                "an (images, labels) training step here)" if name in models.list_models() else ""
        raise ModelSpecError(f"model {spec!r}: torchvision has no classification model {name!r}{other}"
                             f"{did_you_mean(name, classification)}; torchvision.models.list_models() lists them")
    crop = getattr(models.get_model_weights(name).DEFAULT.transforms(), "crop_size", None) or [224]
    shape = _image_shape(shape, (3, crop[0], crop[0]), spec)
    try:                              # ViTs fix their position embedding at construction; other models take any size
        model = _construct(spec, models.get_model, name, weights=None, image_size=shape[1])
    except _NoSuchArgument:
        model = _construct(spec, models.get_model, name, weights=None)
    return _Built(model, "torchvision", "image", shape)


def _build_hf(spec: str, name: str, shape):
    if "/" in name:
        raise ModelSpecError(f"model {spec!r}: hf:NAME takes a transformers model type (swin, vit, bert, resnet, "
                             f"...) whose default config is built with random weights, not a Hub repository "
                             f"(nothing is downloaded)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = _need("transformers", spec)
    from transformers.models.auto import modeling_auto

    image_heads = modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    text_heads = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    if name not in image_heads and name not in text_heads:
        known = ("a transformers model type without" if name in transformers.CONFIG_MAPPING
                 else "not a transformers model type with")
        raise ModelSpecError(f"model {spec!r}: {name!r} is {known} an image- or sequence-classification head"
                             f"{did_you_mean(name, sorted(set(image_heads) | set(text_heads)))}; e.g. swin, vit, "
                             f"resnet, convnext (images), bert, roberta, distilbert (text)")
    config = transformers.CONFIG_MAPPING[name]()
    if name in image_heads:
        size = getattr(config, "image_size", 224)
        size = (size, size) if isinstance(size, int) else tuple(size)
        shape = _image_shape(shape, (getattr(config, "num_channels", 3), *size), spec)
        note = _fit_hf_image_config(config, shape)
        model = _construct(spec, transformers.AutoModelForImageClassification.from_config, config)
        return _Built(model, "hf", "image", shape, note=note)
    if shape is not None and len(shape) != 1:
        raise ModelSpecError(f"model {spec!r} takes text: the input shape is one number, the sequence length, "
                             f"got {','.join(map(str, shape))}")
    length = int(shape[0]) if shape else min(DEFAULT_TEXT_LENGTH, getattr(config, "max_position_embeddings", 512))
    if length > getattr(config, "max_position_embeddings", length):
        raise ModelSpecError(f"model {spec!r}: sequence length {length} exceeds its max_position_embeddings "
                             f"{config.max_position_embeddings}")
    model = _construct(spec, transformers.AutoModelForSequenceClassification.from_config, config)
    return _Built(model, "hf", "text", (length,), vocab_size=config.vocab_size)


def _fit_hf_image_config(config, shape: Tuple[int, int, int]) -> str:
    """Set the config's image size and channels to ``shape``; shrink a Swin-style window if it must.

    Hugging Face's Swin uses one ``window_size`` in every stage and shrinks a stage's window to its feature
    map when the map is smaller, while the relative-position table keeps the configured size, so the
    forward fails (e.g. at 64 px: the last stage is 2x2, the table 7x7). A window no larger than the last
    stage's map avoids that; timm does the same per stage.
    """
    if hasattr(config, "image_size"):
        config.image_size = shape[1] if shape[1] == shape[2] else list(shape[1:])
    if hasattr(config, "num_channels"):
        config.num_channels = shape[0]
    window, patch, depths = (getattr(config, k, None) for k in ("window_size", "patch_size", "depths"))
    if isinstance(window, int) and isinstance(patch, int) and depths:
        last = min(shape[1:]) // patch // 2 ** (len(depths) - 1)
        if 0 < last < window:
            config.window_size = last
            return f"window_size {window} -> {last} so the last stage ({last}x{last}) holds a whole window"
    return ""


def _build_file(spec: str, shape):
    path_text, _, factory_name = spec.rpartition(":")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ModelSpecError(f"model {spec!r}: no file {str(path)!r} (the form is path/to/file.py:factory)")
    module_spec = importlib.util.spec_from_file_location(f"aiak_model_spec_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ModelSpecError(f"model {spec!r}: importing {str(path)!r} raised {type(e).__name__}: {e}") from e
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ModelSpecError(f"model {spec!r}: {str(path)!r} has no function {factory_name!r}"
                             f"{did_you_mean(factory_name, names)}")
    try:
        made = factory()
    except Exception as e:
        raise ModelSpecError(f"model {spec!r}: {factory_name}() raised {type(e).__name__}: {e}") from e
    declared = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, declared = made
    if not isinstance(made, nn.Module):
        raise ModelSpecError(f"model {spec!r}: {factory_name}() must return an nn.Module or (nn.Module, (C, H, W)), "
                             f"got {type(made).__name__}")
    if declared is not None:
        declared = _image_shape(tuple(declared), (), spec)
    shape = _image_shape(shape, declared or (3, 224, 224), spec)
    return _Built(made, "file", "image", shape)


def _build_family(spec: str, shape: Optional[Tuple[int, ...]]) -> _Built:
    if spec == "demo":
        return _build_demo(spec, shape)
    family, sep, name = spec.partition(":")
    if sep and family in ("timm", "torchvision", "hf") and name:
        return {"timm": _build_timm, "torchvision": _build_torchvision, "hf": _build_hf}[family](spec, name, shape)
    head, sep, factory = spec.rpartition(":")
    if sep and head.endswith(".py") and factory:
        return _build_file(spec, shape)
    hint = did_you_mean(family, ("demo", "timm", "torchvision", "hf")) if sep or spec else ""
    raise ModelSpecError(f"unknown model spec {spec!r}{hint}; the forms are {SPEC_FORMS}")


# ------------------------------------------------------------------------------------------ the setup

def parse_input_shape(text: str) -> Tuple[int, ...]:
    """``"3,64,64"`` -> ``(3, 64, 64)`` (images: C,H,W) or ``"128"`` -> ``(128,)`` (text: sequence length)."""
    try:
        shape = tuple(int(v) for v in str(text).replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) not in (1, 3) or min(shape) < 1:
        raise ModelSpecError(f"bad input shape {text!r}: give C,H,W for images (e.g. 3,64,64) or one number, the "
                             f"sequence length, for text models (e.g. 128); every number >= 1")
    return shape


def _uses_attention(model: nn.Module) -> bool:
    from aiak.strategy.select import model_features

    return bool(model_features(model) & {"multihead_attention", "window_attention"})


def default_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW(5e-4, wd 0.05) for transformers and text models, else SGD(0.01, momentum 0.9): see the module doc."""
    if kind == "text" or _uses_attention(model):
        return torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.05)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _count_outputs(model: nn.Module, kind: str, shape: Tuple[int, ...], spec: str) -> int:
    """One sample through the model in eval mode, without gradients: checks that it takes ``shape`` (one clear
    error now rather than a puzzling one in the first step) and counts its classes. Materialises lazy
    modules before the optimizer collects the parameters."""
    was_training = model.training
    sample = ({"input_ids": torch.ones(1, shape[0], dtype=torch.long),
               "attention_mask": torch.ones(1, shape[0], dtype=torch.long)} if kind == "text"
              else {"x": torch.zeros(1, *shape)})
    try:
        with torch.no_grad():
            model.eval()
            out = model(**sample) if kind == "text" else model(sample["x"])
            outputs = int(logits_of(out).shape[-1])
    except Exception as e:
        what = f"{shape[0]} tokens" if kind == "text" else f"images of shape {'x'.join(map(str, shape))}"
        raise ModelSpecError(f"model {spec!r} does not take {what}: {type(e).__name__}: {e}") from e
    finally:
        model.train(was_training)
    if outputs < 2:
        raise ModelSpecError(f"model {spec!r} returns {outputs} score(s) per sample; a classification head with "
                             f"at least 2 classes is needed for the synthetic labels")
    return outputs


def from_model(model: nn.Module, *, spec: str, kind: str = "image", input_shape: Sequence[int],
               batch_size: int = 32, samples: Optional[int] = None, seed: int = 0,
               vocab_size: Optional[int] = None, optimizer: Optional[torch.optim.Optimizer] = None,
               family: str = "", note: str = "") -> ModelSetup:
    """A `ModelSetup` around a model built elsewhere (a benchmark's small variant, a test's model).

    ``spec`` only names the model in the description. ``kind`` is ``"image"`` (``input_shape`` C,H,W) or
    ``"text"`` (``input_shape`` (length,), ``vocab_size`` needed). The optimizer defaults to
    `default_optimizer`.
    """
    if kind not in ("image", "text"):
        raise ValueError(f"kind must be 'image' or 'text', got {kind!r}")
    if int(batch_size) < 1:
        raise ModelSpecError(f"batch size must be >= 1, got {batch_size}")
    if kind == "text" and not vocab_size:
        raise ValueError("a text model needs vocab_size")
    shape = tuple(int(v) for v in input_shape)
    samples = BATCHES_PER_SETUP * batch_size if samples is None else int(samples)
    if samples < batch_size:
        raise ModelSpecError(f"samples ({samples}) must be at least the batch size ({batch_size}): the loader "
                             f"drops the last partial batch so that every batch has one shape")
    classes = min(MAX_LABELS, _count_outputs(model, kind, shape, spec))
    dataset = (SyntheticText(samples, shape[0], vocab_size, classes, seed) if kind == "text"
               else SyntheticImages(samples, shape, classes, seed))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(seed))
    optimizer = default_optimizer(model, kind) if optimizer is None else optimizer
    params = sum(p.numel() for p in model.parameters())
    data = f"{shape[0]} tokens" if kind == "text" else "x".join(map(str, shape))
    description = (f"{spec}: {(family + ' ') if family else ''}{type(model).__name__}, {_human(params)} parameters, "
                   f"input {data}, batch {batch_size}, {type(optimizer).__name__}" + (f" ({note})" if note else ""))
    return ModelSetup(model, optimizer, loader, description, shape, int(batch_size), kind)


def build(spec: str, *, batch_size: Optional[int] = None, input_shape: Optional[Sequence[int]] = None,
          samples: Optional[int] = None, seed: int = 0) -> ModelSetup:
    """Build the model a SPEC names (random weights, nothing downloaded) with an optimizer and a loader of
    ``samples`` synthetic samples (default 16 batches) in batches of ``batch_size`` (default 64 for ``demo``,
    32 otherwise). ``input_shape`` overrides the image size (C, H, W), or the sequence length (one number)
    for a text model; models that fix their size at construction (timm ViT/Swin, torchvision ViT, Hugging
    Face image models) are built for it. Raises `ModelSpecError` for a SPEC that cannot be built.

    Weights come from ``torch.manual_seed(seed)`` inside a forked RNG: the same SPEC and seed give the same
    model, and the caller's RNG state is left as it was.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string; the forms are {SPEC_FORMS}")
    spec = spec.strip()
    shape = tuple(int(v) for v in input_shape) if input_shape is not None else None
    if shape is not None and (len(shape) not in (1, 3) or min(shape) < 1):
        raise ModelSpecError(f"bad input shape {shape}: C,H,W for images or (length,) for text, every number >= 1")
    if batch_size is not None and int(batch_size) < 1:
        raise ModelSpecError(f"batch size must be >= 1, got {batch_size}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = _build_family(spec, shape)
        batch = int(batch_size) if batch_size is not None else DEFAULT_BATCH_SIZE.get(built.family, 32)
        return from_model(built.model, spec=spec, kind=built.kind, input_shape=built.input_shape, batch_size=batch,
                          samples=samples, seed=seed, vocab_size=built.vocab_size,
                          family=_LIBRARY.get(built.family, ""), note=built.note)


def _human(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)
