"""Does mixed precision hold on real architectures? A correctness sweep of ``aiak.optimize`` over a model zoo.

    OMP_NUM_THREADS=1 python benchmarks/precision_zoo.py [--models timm:resnet10t,hf:bert,...]
                                                         [--precisions "O2 bf16,O1 fp16"] [--json FILE]
                                                         [--compiled]

The zoo (``CASES``, 50+ models): timm, torchvision and Hugging Face transformers architectures (CNNs with
BatchNorm, none, depthwise and grouped convolutions, squeeze-excite; ViT, DeiT, Swin, ConvNeXt, MLP-Mixer, MaxViT,
EVA-02, CaiT, BEiT, LeViT, MobileViT; text encoders, decoders with tied embeddings / RoPE / ALiBi, encoder-decoders;
Whisper and wav2vec2 audio), each in its smallest configuration: 28-64 px images, 16 tokens, hidden size 32, 2
layers, vocabulary 256, batch 2, random weights, nothing downloaded. Named timm and torchvision models are built
by :func:`aiak.cli.model_spec.build` (the ``timm:NAME`` / ``torchvision:NAME`` SPECs, with their own
synthetic data); those a SPEC cannot shrink (timm's Swin, Mixer, CaiT, BEiT, and every Hugging Face model: an
``hf:NAME`` SPEC builds the default, full-size config) are built here from a small config, with their batch
from model_spec's :class:`~aiak.cli.model_spec.SyntheticImages` / ``SyntheticText``.

For each model and precision (``O2 bf16`` and ``O1 fp16`` by default; ``O2 fp16`` and ``O1 bf16`` with
``--precisions``; each a strategy
``{"precision": {"level": ..., "dtype": ...}}``), with a fresh model from the same seed and
``torch.optim.AdamW``, the checks, in order:

1. ``optimize``: ``aiak.optimize(model, opt, strategy=...)``; an exception there (``aiak.StrategyError`` or
   another) is a *refusal*: the cell says ``refused at optimize(): <message>`` and counts as a clean one;
2. ``train``: two training steps (forward; cross-entropy on the logits, or the Hugging Face model's own
   ``outputs.loss`` from its labels; ``backward``, ``step``, ``zero_grad``): each loss finite, and afterwards
   every parameter still fp32 and still the object the optimizer holds (the same objects as before optimize);
3. ``eval``: ``model.eval()``, ``with torch.inference_mode(): model(x)``: every floating output finite; then
   ``model.train()``;
4. ``state_dict``: ``model.state_dict()`` has the keys and dtypes of a plain copy of the model made before
   optimize;
5. ``resume``: model and optimizer state dicts through ``torch.save`` into memory, a fresh model + AdamW through
   ``aiak.optimize`` the same way, both state dicts loaded, then one more step of the original and of the
   resumed run on the same batch (same RNG seed, for dropout): the parameters must be equal (``torch.equal``;
   otherwise the largest difference is reported).

A check that raises records ``check: ExceptionType: first line of the message``. If ``train`` fails the later
checks are not run (``skipped``); ``eval``, ``state_dict`` and ``resume`` are independent of each other. The
table shows each cell's first failure (``+N`` more failures: see the list under the table and ``--json``);
the summary counts the cells that passed, failed and were refused. The seconds per model go to stderr.

Not a check, a note: the first training step counts the ``Linear`` / ``Conv`` calls whose output is fp16/bf16. A
cell that passed with some of them in fp32 says ``pass (note: H/N ...)``: correct, but not all in half precision
(O2 keeps normalization layers, and what aiak takes for one, in fp32).

``--compiled`` adds the compiled column: for each model and precision, the graphs (and graph breaks) dynamo makes of
the forward (``torch._dynamo.explain``: traced, not compiled) for the model under ``aiak.optimize`` and for the
same model called inside plain ``torch.autocast`` of that dtype (:func:`compiled_graphs`). aiak's regions are traced
into the model's graph (:mod:`aiak.amp.compiled_region`): a cell where aiak makes more graphs is marked.

Run with one thread on a shared CPU (``OMP_NUM_THREADS=1``; the script also calls ``torch.set_num_threads``
with ``--threads``, default 1). fp16 on a CPU without AVX512-FP16 is emulated and slow: the inputs are tiny.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # nothing is downloaded: random weights only

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import aiak  # noqa: E402
from aiak.cli import model_spec  # noqa: E402
from aiak.util.nested import iter_tensors, logits_of  # noqa: E402

PRECISIONS: Dict[str, dict] = {
    "O2 bf16": {"precision": {"level": "O2", "dtype": "bf16"}},
    "O1 fp16": {"precision": {"level": "O1", "dtype": "fp16"}},
    "O2 fp16": {"precision": {"level": "O2", "dtype": "fp16"}},
    "O1 bf16": {"precision": {"level": "O1", "dtype": "bf16"}},
}
DEFAULT_PRECISIONS = ("O2 bf16", "O1 fp16")  # apex's O2 where bf16 is native, and the fp16 path with loss scaling
CHECKS = ("optimize", "train", "eval", "state_dict", "resume")
BATCH = 2
TEXT_LENGTH = 16
VOCAB = 256
CLASSES = 2                 # synthetic labels; every head here has at least 2 outputs
TRAIN_STEPS = 2
LR = 1e-3


# ------------------------------------------------------------------------------------------ the zoo

@dataclass(frozen=True)
class Case:
    """One model of the zoo.

    ``task`` says how a batch is made and what the loss is: ``image`` (cross-entropy on the logits of
    ``model(x)``, :func:`aiak.cli.model_spec.compute_loss`), ``hf-image`` / ``hf-cls`` (a Hugging Face
    classification head given ``labels``: ``outputs.loss``), ``hf-lm`` (causal LM, labels = the input ids with
    padding ignored), ``hf-seq2seq`` (labels = the first half of the input ids), ``hf-whisper`` (log-mel
    features in, tokens out), ``hf-audio`` (a raw waveform, a sequence-classification head).
    ``build`` None: the model is ``model_spec.build(spec, input_shape=shape)``; else ``build()`` makes it
    (called under the case's seed).
    """

    spec: str
    shape: Tuple[int, ...]
    task: str = "image"
    build: Optional[Callable[[], nn.Module]] = None
    kind: str = ""                                   # what it is (in --json)


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def make():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
    return make


def _hf(model_type: str, head: str, **config) -> Callable[[], nn.Module]:
    """A transformers model of ``model_type`` from a small config (``AutoConfig.for_model``), with the head
    of the Auto class ``head`` (e.g. ``AutoModelForSequenceClassification``)."""
    def make():
        import transformers

        cfg = transformers.AutoConfig.for_model(model_type, **config)
        return getattr(transformers, head).from_config(cfg)
    return make


def _mixer() -> nn.Module:
    """timm's MLP-Mixer small: ``mixer_s16_224``'s own arguments fix ``num_blocks`` and ``embed_dim``."""
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=64)


_BERT_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
_GPT2 = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=VOCAB - 1,
             eos_token_id=VOCAB - 1)
_SEQ_CLS, _LM, _S2S = "AutoModelForSequenceClassification", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM"
_IMG_CLS = "AutoModelForImageClassification"

_CASES: List[Case] = [
    # timm: named models at 32 px through model_spec.build, the large ones shrunk here
    Case("timm:resnet10t", (3, 32, 32), kind="CNN, BatchNorm"),
    Case("timm:resnet18", (3, 32, 32), kind="CNN, BatchNorm"),
    Case("timm:densenet121", (3, 32, 32), kind="CNN, dense concatenation"),
    Case("timm:regnetx_002", (3, 32, 32), kind="CNN, grouped convs"),
    Case("timm:efficientnet_b0", (3, 32, 32), kind="CNN, depthwise + squeeze-excite"),
    Case("timm:mobilenetv3_small_050", (3, 32, 32), kind="CNN, hard-swish"),
    Case("timm:convnext_atto", (3, 32, 32), kind="ConvNeXt, LayerNorm2d"),
    Case("timm:nf_resnet26", (3, 32, 32), kind="CNN, no normalization"),
    Case("timm:vit_tiny_patch16_224", (3, 32, 32), kind="ViT"),
    Case("timm:deit_tiny_distilled_patch16_224", (3, 32, 32), kind="DeiT, distillation token"),
    Case("timm:eva02_tiny_patch14_224", (3, 28, 28), kind="EVA-02, rotary embedding, SwiGLU"),
    Case("timm:test_maxvit", (3, 64, 64), kind="MaxViT, window + grid attention"),
    Case("timm:swin_tiny_patch4_window7_224", (3, 32, 32), kind="Swin (dim 24, depths 1,1,2,1, window 4)",
         build=_timm("swin_tiny_patch4_window7_224", img_size=32, window_size=4, embed_dim=24,
                     depths=(1, 1, 2, 1), num_heads=(1, 2, 4, 8))),
    Case("timm:mixer_s16_224", (3, 32, 32), kind="MLP-Mixer (patch 8, dim 64, 2 blocks)", build=_mixer),
    Case("timm:cait_xxs24_224", (3, 32, 32), kind="CaiT (2 blocks), class attention, LayerScale",
         build=_timm("cait_xxs24_224", img_size=32, depth=2)),
    Case("timm:beit_base_patch16_224", (3, 32, 32), kind="BEiT (dim 64, 2 blocks), relative position bias",
         build=_timm("beit_base_patch16_224", img_size=32, depth=2, embed_dim=64, num_heads=2)),
    Case("timm:levit_128s", (3, 32, 32), kind="LeViT, Linear+BatchNorm, cached attention biases in eval"),
    Case("timm:mobilevit_xxs", (3, 64, 64), kind="MobileViT, convs + transformer"),
    Case("timm:efficientformerv2_s0", (3, 64, 64), kind="EfficientFormerV2"),
    Case("timm:coat_lite_tiny", (3, 32, 32), kind="CoaT-Lite, conv-attentional"),
    # torchvision: classification models through model_spec.build
    Case("torchvision:resnet18", (3, 32, 32), kind="CNN, BatchNorm"),
    Case("torchvision:mobilenet_v3_small", (3, 32, 32), kind="CNN, hard-swish, squeeze-excite"),
    Case("torchvision:shufflenet_v2_x0_5", (3, 32, 32), kind="CNN, channel shuffle"),
    Case("torchvision:squeezenet1_1", (3, 64, 64), kind="CNN, no BatchNorm"),
    Case("torchvision:efficientnet_b0", (3, 32, 32), kind="CNN, stochastic depth"),
    Case("torchvision:regnet_y_400mf", (3, 32, 32), kind="CNN, grouped + squeeze-excite"),
    Case("torchvision:googlenet", (3, 64, 64), kind="Inception, aux logits in training"),
    Case("torchvision:swin_t", (3, 32, 32), kind="Swin, shifted windows"),
    # Hugging Face transformers: small configs (2 layers, hidden 32, vocab 256, 16 tokens)
    Case("hf:bert", (TEXT_LENGTH,), "hf-cls", _hf("bert", _SEQ_CLS, **_BERT_LIKE), kind="encoder"),
    Case("hf:roberta", (TEXT_LENGTH,), "hf-cls",
         _hf("roberta", _SEQ_CLS, **{**_BERT_LIKE, "pad_token_id": 1}), kind="encoder"),
    Case("hf:distilbert", (TEXT_LENGTH,), "hf-cls",
         _hf("distilbert", _SEQ_CLS, dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
             max_position_embeddings=64, pad_token_id=0), kind="encoder"),
    Case("hf:albert", (TEXT_LENGTH,), "hf-cls", _hf("albert", _SEQ_CLS, embedding_size=16, **_BERT_LIKE),
         kind="encoder, shared layers"),
    Case("hf:mobilebert", (TEXT_LENGTH,), "hf-cls",
         _hf("mobilebert", _SEQ_CLS, **_BERT_LIKE, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
             num_feedforward_networks=1), kind="encoder, bottlenecks, NoNorm"),
    Case("hf:electra", (TEXT_LENGTH,), "hf-cls", _hf("electra", _SEQ_CLS, embedding_size=16, **_BERT_LIKE),
         kind="encoder"),
    Case("hf:deberta-v2", (TEXT_LENGTH,), "hf-cls", _hf("deberta-v2", _SEQ_CLS, **_BERT_LIKE),
         kind="encoder, disentangled attention"),
    Case("hf:gpt2", (TEXT_LENGTH,), "hf-lm", _hf("gpt2", _LM, **_GPT2), kind="decoder, tied embeddings"),
    Case("hf:llama", (TEXT_LENGTH,), "hf-lm", _hf("llama", _LM, **_DECODER), kind="decoder, RMSNorm, RoPE, GQA"),
    Case("hf:qwen2", (TEXT_LENGTH,), "hf-lm", _hf("qwen2", _LM, **_DECODER), kind="decoder, RMSNorm, RoPE"),
    Case("hf:mistral", (TEXT_LENGTH,), "hf-lm", _hf("mistral", _LM, **_DECODER, sliding_window=8),
         kind="decoder, sliding window"),
    Case("hf:bloom", (TEXT_LENGTH,), "hf-lm", _hf("bloom", _LM, hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB),
         kind="decoder, ALiBi"),
    Case("hf:opt", (TEXT_LENGTH,), "hf-lm",
         _hf("opt", _LM, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, vocab_size=VOCAB,
             max_position_embeddings=64, word_embed_proj_dim=32), kind="decoder"),
    Case("hf:gpt2-cls", (TEXT_LENGTH,), "hf-cls", _hf("gpt2", _SEQ_CLS, **_GPT2, pad_token_id=0),
         kind="decoder, last-token classification"),
    Case("hf:t5", (TEXT_LENGTH,), "hf-seq2seq",
         _hf("t5", _S2S, d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2,
             vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0), kind="encoder-decoder, T5LayerNorm"),
    Case("hf:bart", (TEXT_LENGTH,), "hf-seq2seq",
         _hf("bart", _S2S, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
             max_position_embeddings=64), kind="encoder-decoder"),
    Case("hf:vit", (3, 32, 32), "hf-image",
         _hf("vit", _IMG_CLS, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             image_size=32, patch_size=8), kind="ViT"),
    Case("hf:beit", (3, 32, 32), "hf-image",
         _hf("beit", _IMG_CLS, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             image_size=32, patch_size=8, use_relative_position_bias=True), kind="BEiT, relative position bias"),
    Case("hf:mobilevit", (3, 64, 64), "hf-image",
         _hf("mobilevit", _IMG_CLS, image_size=64, hidden_sizes=[16, 24, 32],
             neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32]), kind="MobileViT"),
    Case("hf:swin", (3, 32, 32), "hf-image",
         _hf("swin", _IMG_CLS, image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
             window_size=4), kind="Swin"),
    Case("hf:convnext", (3, 32, 32), "hf-image",
         _hf("convnext", _IMG_CLS, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32),
         kind="ConvNeXt"),
    Case("hf:resnet", (3, 32, 32), "hf-image",
         _hf("resnet", _IMG_CLS, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"),
         kind="CNN, BatchNorm"),
    Case("hf:whisper", (8, 32), "hf-whisper",
         _hf("whisper", "AutoModelForSpeechSeq2Seq", d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
             num_mel_bins=8, max_source_positions=16, max_target_positions=32, vocab_size=VOCAB, pad_token_id=0,
             decoder_start_token_id=1, eos_token_id=2, bos_token_id=1), kind="audio encoder-decoder"),
    Case("hf:wav2vec2", (1600,), "hf-audio",
         _hf("wav2vec2", "AutoModelForAudioClassification", hidden_size=32, num_hidden_layers=2,
             num_attention_heads=2, intermediate_size=64, conv_dim=(16,) * 7, num_conv_pos_embeddings=16,
             num_conv_pos_embedding_groups=2, mask_time_prob=0.0, classifier_proj_size=16),
         kind="audio, conv feature extractor, GroupNorm"),
]
CASES: Dict[str, Case] = {c.spec: c for c in _CASES}
QUICK = ("timm:resnet10t", "torchvision:mobilenet_v3_small", "hf:bert", "hf:gpt2", "timm:vit_tiny_patch16_224",
         "torchvision:swin_t")  # (swin_t: a position-bias table of its own class, indexed under inference_mode)


# ------------------------------------------------------------------------------------------ a run

@dataclass
class Run:
    """A model of the zoo with its AdamW, a fixed batch and the loss its task computes."""

    case: Case
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    half_calls: Tuple[int, int] = (0, 0)     # (Linear/Conv calls computing in half, all) in the first step
    last_loss: float = float("nan")

    def forward(self) -> Any:
        b, task = self.batch, self.case.task
        if task == "image":
            return self.model(b[0])
        if task == "hf-image":
            return self.model(pixel_values=b[0], labels=b[1])
        if task == "hf-whisper":
            return self.model(input_features=b["input_features"], labels=b["labels"])
        if task == "hf-audio":
            return self.model(input_values=b["input_values"], labels=b["labels"])
        return self.model(**b)

    def loss(self) -> torch.Tensor:
        if self.case.task == "image":
            return model_spec.compute_loss(self.model, self.batch)
        return self.forward().loss

    def step(self) -> float:
        loss = self.loss()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


def make_model(case: Case, seed: int = 0) -> nn.Module:
    """The case's model with weights from ``seed`` (the caller's RNG is left as it was)."""
    if case.build is None:
        return model_spec.build(case.spec, batch_size=BATCH, input_shape=case.shape, samples=BATCH, seed=seed).model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return case.build()


def make_batch(case: Case, seed: int = 0) -> Any:
    """One batch of ``BATCH`` samples for the case's task, from model_spec's synthetic data sets."""
    if case.task in ("image", "hf-image"):
        data = model_spec.SyntheticImages(BATCH, case.shape, num_classes=CLASSES, seed=seed)
        return next(iter(DataLoader(data, batch_size=BATCH)))
    g = torch.Generator().manual_seed(seed)
    if case.task == "hf-whisper":          # (mel bins, frames) features; 8 decoder tokens
        return {"input_features": torch.randn(BATCH, *case.shape, generator=g),
                "labels": torch.randint(3, VOCAB, (BATCH, 8), generator=g)}
    if case.task == "hf-audio":            # a raw waveform
        return {"input_values": torch.randn(BATCH, *case.shape, generator=g),
                "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)}
    text = next(iter(DataLoader(model_spec.SyntheticText(BATCH, case.shape[0], VOCAB, CLASSES, seed),
                                batch_size=BATCH)))
    ids, mask = text["input_ids"], text["attention_mask"]
    if case.task == "hf-lm":
        text["labels"] = ids.masked_fill(mask == 0, -100)
    elif case.task == "hf-seq2seq":
        text["labels"] = ids[:, : case.shape[0] // 2].masked_fill(mask[:, : case.shape[0] // 2] == 0, -100)
    return text


class Refused(Exception):
    """``aiak.optimize`` raised: the message is ``refused at optimize(): ExceptionType: first line``."""


def new_run(case: Case, strategy: dict, seed: int = 0) -> Tuple[Run, nn.Module, List[nn.Parameter]]:
    """A fresh seeded model + AdamW through ``aiak.optimize``; also a plain copy made before optimize and the
    parameters as built. Anything optimize raises (``aiak.StrategyError`` or another) becomes :class:`Refused`."""
    model = make_model(case, seed)
    plain = copy.deepcopy(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):     # optimize()'s two "applied strategy" lines
            model, opt, *_ = aiak.optimize(model, opt, strategy=copy.deepcopy(strategy))
    except Exception as e:  # noqa: BLE001 - whatever optimize raises is how it refuses
        raise Refused(f"refused at optimize(): {_first_line(e)}") from e
    return Run(case, model, opt, make_batch(case, seed)), plain, params


# ------------------------------------------------------------------------------------------ the checks

def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _all_finite(obj: Any) -> Tuple[bool, int]:
    """(every floating tensor in ``obj`` finite, how many floating tensors there were)."""
    tensors = [t for t in iter_tensors(obj) if t.is_floating_point()]
    return all(bool(torch.isfinite(t).all()) for t in tensors), len(tensors)


_COMPUTE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def half_outputs(run: Run) -> Tuple[int, int]:
    """One training step of ``run``; returns (Linear/Conv calls whose output was fp16/bf16, all such calls).

    Not a check: a note for a cell that passed without computing in half (e.g. a model aiak takes for a
    normalization layer as a whole, which O2 keeps in fp32).
    """
    seen: List[bool] = []
    record = lambda m, args, out: seen.append(  # noqa: E731
        isinstance(out, torch.Tensor) and out.dtype in (torch.float16, torch.bfloat16))
    handles = [m.register_forward_hook(record) for m in run.model.modules() if isinstance(m, _COMPUTE_LAYERS)]
    try:
        run.last_loss = run.step()
    finally:
        for h in handles:
            h.remove()
    return sum(seen), len(seen)


def check_train(run: Run, params: List[nn.Parameter]) -> Optional[str]:
    for i in range(TRAIN_STEPS):
        if i == 0:
            run.half_calls = half_outputs(run)
            loss = run.last_loss
        else:
            loss = run.step()
        if not math.isfinite(loss):
            return f"loss not finite at step {i + 1}: {loss}"
    now = list(run.model.parameters())
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        return "model.parameters() are not the objects it was built with"
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    if held != {id(p) for p in now}:
        return "the optimizer does not hold the model's parameters"
    not_fp32 = [(n, p.dtype) for n, p in run.model.named_parameters() if p.dtype != torch.float32]
    if not_fp32:
        return f"{len(not_fp32)} parameter(s) not fp32, e.g. {not_fp32[0][0]}: {not_fp32[0][1]}"
    return None


def check_eval(run: Run) -> Optional[str]:
    run.model.eval()
    try:
        with torch.inference_mode():
            out = run.forward()
        finite, count = _all_finite(out if run.case.task != "image" else logits_of(out))
        if count == 0:
            return "no floating output"
        return None if finite else "output not finite"
    finally:
        run.model.train()


def check_state_dict(run: Run, plain: nn.Module) -> Optional[str]:
    got = {k: v.dtype for k, v in run.model.state_dict().items()}
    want = {k: v.dtype for k, v in plain.state_dict().items()}
    if got.keys() != want.keys():
        extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
        return f"keys differ: {len(extra)} extra {extra[:2]}, {len(missing)} missing {missing[:2]}"
    differ = [k for k in want if got[k] != want[k]]
    if differ:
        return f"{len(differ)} dtype(s) differ, e.g. {differ[0]}: {got[differ[0]]} (plain {want[differ[0]]})"
    return None


def check_resume(run: Run, strategy: dict, seed: int) -> Optional[str]:
    buffer = io.BytesIO()
    torch.save({"model": run.model.state_dict(), "opt": run.optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, _, _ = new_run(run.case, strategy, seed)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["opt"])
    for r in (run, resumed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)      # the same dropout masks
            r.step()
    a, b = dict(run.model.named_parameters()), dict(resumed.model.named_parameters())
    if a.keys() != b.keys():
        return "the resumed model has other parameters"
    unequal = [n for n in a if not torch.equal(a[n], b[n])]
    if unequal:
        diff = max(float((a[n].detach() - b[n].detach()).abs().max()) for n in unequal)
        return f"parameters differ after one step: {len(unequal)}/{len(a)}, max |diff| {diff:.3g} ({unequal[0]})"
    return None


@contextlib.contextmanager
def _aiak_logger_quiet():
    """The ``aiak`` logger below ERROR (its "applied strategy" lines, twice per cell); warnings are recorded."""
    logger = logging.getLogger("aiak")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_cell(case: Case, precision: str, seed: int = 0) -> dict:
    """All checks of one model under one precision: ``{"status": "pass" | "fail" | "refused", "checks": {check:
    None (passed) | "skipped" | what failed}, "failures": ["check: what failed", ...], "half_calls": [Linear/Conv
    calls that computed in half, all of them] in the first step, "warnings": aiak's warnings, first lines}``."""
    strategy = PRECISIONS[precision]
    checks: Dict[str, Optional[str]] = {}
    cell: Dict[str, Any] = {"status": "pass", "checks": checks, "failures": [], "half_calls": None, "warnings": []}
    with warnings.catch_warnings(record=True) as seen, _aiak_logger_quiet():
        warnings.simplefilter("always")
        try:
            run, plain, params = new_run(case, strategy, seed)
        except Refused as e:
            checks["optimize"] = str(e)
            cell.update(status="refused", failures=[str(e)])
        else:
            checks["optimize"] = None
            steps: List[Tuple[str, Callable[[], Optional[str]]]] = [
                ("train", lambda: check_train(run, params)), ("eval", lambda: check_eval(run)),
                ("state_dict", lambda: check_state_dict(run, plain)),
                ("resume", lambda: check_resume(run, strategy, seed))]
            for name, fn in steps:
                if name != "train" and checks["train"] is not None:
                    checks[name] = "skipped"       # nothing trained: the later checks would say nothing
                    continue
                try:
                    checks[name] = fn()
                except Exception as e:  # noqa: BLE001 - the sweep goes on; the failure is the finding
                    checks[name] = _first_line(e)
            cell["half_calls"] = list(run.half_calls)
            cell["failures"] = [f"{name}: {what}" for name, what in checks.items() if what not in (None, "skipped")]
            cell["status"] = "fail" if cell["failures"] else "pass"
        cell["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in seen if "aiak" in str(w.message)})
    return cell


# ------------------------------------------------------------------------------------------ under torch.compile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _graphs(fn: Callable[[], Any]) -> Tuple[int, int]:
    """(graphs, graph breaks) dynamo makes of ``fn`` (``torch._dynamo.explain``: traced, not compiled)."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)()
    return explained.graph_count, explained.graph_break_count


def compiled_graphs(case: Case, precision: str, seed: int = 0) -> Dict[str, Tuple[int, int]]:
    """What ``torch.compile`` of the model's forward makes (graphs, breaks), for the model under ``aiak.optimize``
    with ``precision`` and for the same model in plain ``torch.autocast`` of that dtype: ``{"plain": .., "aiak":
    ..}``. aiak's regions add nothing to dynamo's graphs when the two are equal."""
    level, dtype = precision.split()
    with warnings.catch_warnings(), _aiak_logger_quiet():
        warnings.simplefilter("ignore")
        run, plain, _ = new_run(case, PRECISIONS[precision], seed)
        plain_run = Run(case, plain, torch.optim.AdamW(plain.parameters(), lr=LR), run.batch)
        with torch.autocast("cpu", dtype=DTYPES[dtype]):
            plain_graphs = _graphs(plain_run.forward)
        return {"plain": plain_graphs, "aiak": _graphs(run.forward)}


def compiled_table(names: List[str], precisions: List[str], seed: int = 0) -> Dict[str, Dict[str, dict]]:
    """The compiled column: per model and precision, the graphs (breaks) of plain autocast and of aiak, printed as a
    table with a count of the cells where aiak makes more graphs."""
    found: Dict[str, Dict[str, dict]] = {}
    print("\n| model | " + " | ".join(f"{p}: graphs (breaks) plain / aiak" for p in precisions) + " |")
    print("|---" * (len(precisions) + 1) + "|")
    for name in names:
        cells = found[name] = {}
        for precision in precisions:
            try:
                cells[precision] = compiled_graphs(CASES[name], precision, seed)
            except Exception as e:  # noqa: BLE001 - a model dynamo cannot trace at all is a finding too
                cells[precision] = {"error": _first_line(e)}
        print(f"| {name} | " + " | ".join(_graphs_text(cells[p]) for p in precisions) + " |", flush=True)
    more = sum(1 for cells in found.values() for c in cells.values() if "error" in c or c["aiak"][0] > c["plain"][0])
    print(f"\naiak makes more graphs than plain autocast in {more} of {len(names) * len(precisions)} cells")
    return found


def _graphs_text(cell: dict) -> str:
    if "error" in cell:
        return cell["error"].replace("|", "\\|")
    (pg, pb), (ag, ab) = cell["plain"], cell["aiak"]
    return f"{pg} ({pb}) / {ag} ({ab})" + (" **more**" if ag > pg else "")


def sweep_model(case: Case, precisions: List[str], seed: int = 0) -> Dict[str, dict]:
    """Every precision of one model; an error outside the checks (building the model, say) fills its cells."""
    cells = {}
    for precision in precisions:
        try:
            cells[precision] = check_cell(case, precision, seed)
        except Exception as e:  # noqa: BLE001
            what = f"setup: {_first_line(e)}"
            cells[precision] = {"status": "fail", "checks": {}, "failures": [what], "half_calls": None,
                                "warnings": []}
    return cells


# ------------------------------------------------------------------------------------------ the report

def cell_text(cell: dict, width: int = 110) -> str:
    if cell["status"] == "pass":
        half, calls = cell.get("half_calls") or (0, 0)
        return "pass" if half == calls else f"pass (note: {half}/{calls} Linear/Conv calls computed in half)"
    first = cell["failures"][0]
    more = len(cell["failures"]) - 1
    text = first if len(first) <= width else first[: width - 3] + "..."
    return (text + (f" (+{more})" if more else "")).replace("|", "\\|")


def table(results: Dict[str, Dict[str, dict]], precisions: List[str]) -> str:
    lines = ["| model | " + " | ".join(precisions) + " |", "|---" * (len(precisions) + 1) + "|"]
    for spec, cells in results.items():
        lines.append(f"| {spec} | " + " | ".join(cell_text(cells[p]) for p in precisions) + " |")
    return "\n".join(lines)


def summary(results: Dict[str, Dict[str, dict]]) -> Dict[str, int]:
    counts = {"pass": 0, "fail": 0, "refused": 0}
    for cells in results.values():
        for cell in cells.values():
            counts[cell["status"]] += 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma-separated subset (default: all {len(CASES)}); "
                                                   f"'quick' = {','.join(QUICK)}")
    ap.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS),
                    help=f"comma-separated: {', '.join(PRECISIONS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--json", default=None, help="write every cell's checks, failures and aiak warnings here")
    ap.add_argument("--compiled", action="store_true",
                    help="also count the graphs torch.compile makes of each forward, aiak against plain autocast")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = list(CASES) if not args.models else list(QUICK) if args.models == "quick" else \
        [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--models: unknown {unknown}; valid: {', '.join(CASES)}")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        ap.error(f"--precisions: unknown {unknown}; valid: {', '.join(PRECISIONS)}")

    print(f"precision_zoo: torch {torch.__version__}, {torch.get_num_threads()} thread(s); {len(names)} models x "
          f"{len(precisions)} precisions; batch {BATCH}, AdamW lr {LR}, {TRAIN_STEPS} steps + 1 resumed step")
    results: Dict[str, Dict[str, dict]] = {}
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        results[name] = sweep_model(CASES[name], precisions, args.seed)
        seconds[name] = time.perf_counter() - t0
        states = ", ".join(f"{p}: {results[name][p]['status']}" for p in precisions)
        print(f"  {name}: {seconds[name]:.1f} s ({states})", file=sys.stderr, flush=True)
    total = time.perf_counter() - start

    print()
    print(table(results, precisions))
    counts = summary(results)
    print(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['refused']} refused "
          f"({len(names)} models x {len(precisions)} precisions, {total:.0f} s)")
    partial = [(n, p) for n, cells in results.items() for p in precisions
               if cells[p]["status"] == "pass" and cells[p]["half_calls"][0] < cells[p]["half_calls"][1]]
    if partial:
        print(f"{len(partial)} of the passed cells ran some Linear/Conv calls in fp32 (a note, not a failure): "
              + ", ".join(f"{n} ({p})" for n, p in partial))
    failing = [(n, p, f) for n, cells in results.items() for p in precisions for f in cells[p]["failures"]]
    if failing:
        print("\nEvery failure:")
        for n, p, f in failing:
            print(f"- {n} ({p}): {f}")
    compiled = compiled_table(names, precisions, args.seed) if args.compiled else None
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "precisions": precisions,
                       "seconds": seconds, "summary": counts, "compiled_graphs": compiled,
                       "results": {n: {"kind": CASES[n].kind, "cells": cells} for n, cells in results.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
