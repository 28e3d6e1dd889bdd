"""Module surgery: a language model's loss from its hidden states, without its logits.

A Hugging Face causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Gemma2ForCausalLM``, ...) runs its
backbone, makes ``logits = lm_head(hidden)`` for every token, transforms them (Gemma-2's soft-capping, Cohere's
scale, Granite's divisor), and passes them to ``self.loss_function``, the causal-LM loss: shift the labels by
one, upcast the logits to fp32, cross-entropy with ``ignore_index``, summed over ``num_items_in_batch`` when the
caller counted the items of a whole accumulation window. A masked LM (``ModernBertForMaskedLM``,
``EuroBertForMaskedLM``) does the same without the shift, and its fused head runs over the tokens it scores
alone. `replace_lm_heads` recognises such a model by its structure (an output embedding that is a linear layer,
a forward taking ``labels`` that reads ``self.loss_function``, which is one of those two losses), never by
importing a library, and swaps the classes of the model and its head in place (`aiak.runtime.class_swap`:
parameters, buffers, ``state_dict`` and tied weights untouched). In training with labels and gradients, the model
runs its own forward with the head capturing its input, then takes the loss from `aiak.ops.linear_cross_entropy`,
with the same shift, transform, ignored tokens and divisor. Evaluation, inference and calls without labels run
the original forward.

The first fused call checks the model's logit transform: the head hands the forward a few real logits, and what
the forward makes of them must be what aiak would (`linear_cross_entropy`'s ``logit_scale`` and ``softcap``,
from the model's config); a forward that does something else runs unfused from then on, with one warning.

The output's ``logits`` are made when a script reads them (``outputs.logits``, ``outputs["logits"]``), with one
warning that the saving is lost for that step; they are left out of ``to_tuple()``. A LoRA adapter on the head
(PEFT's ``lora.Linear``: ``base_layer``, ``lora_A``, ``lora_B``, ``scaling``, ``lora_dropout``) is computed as one
linear layer over the concatenated features ``[x, s * dropout(x) A^T]`` and weights ``[W, B]``: exact, dropout
included, and the gradients land on ``A`` and ``B``.
"""
from __future__ import annotations

import inspect
import logging
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from aiak.ops.linear_cross_entropy import _transform, linear_cross_entropy
from aiak.runtime.class_swap import original_class, restore_class, swap_class, swapped_class
from aiak.util.dist import is_dtensor
from aiak.util.warn import warn, warn_once

__all__ = ["replace_lm_heads", "restore_lm_heads", "lm_head_problem", "fusable_lm_heads", "FusedCausalLM",
           "CapturingHead"]

logger = logging.getLogger("aiak")

# The Hugging Face losses fused, by name, and whether each shifts the labels by one: the causal LM's, and the masked
# LM's (ModernBERT, EuroBERT), which scores every token where its label is not ignored.
LOSSES = {"ForCausalLMLoss": True, "ForMaskedLMLoss": False}
PROBE_COLUMNS = 8


def _head_of(model: nn.Module) -> Optional[nn.Module]:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Module) else getattr(model, "lm_head", None)


def _is_lora_linear(head: nn.Module) -> bool:
    return (isinstance(getattr(head, "base_layer", None), nn.Linear) and isinstance(getattr(head, "lora_A", None),
                                                                                     nn.ModuleDict)
            and isinstance(getattr(head, "lora_B", None), nn.ModuleDict) and hasattr(head, "scaling"))


def _reads_loss_function(cls: type) -> bool:
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in code.co_names


def lm_head_problem(model: nn.Module) -> Optional[str]:
    """Why ``model`` is not a causal or masked LM whose loss can be fused (None when it is), by structure only."""
    forward = getattr(type(model), "forward", None)
    if forward is None or "labels" not in inspect.signature(forward).parameters:
        return "its forward takes no labels"
    head = _head_of(model)
    if head is None:
        return "it has no output embedding (lm_head)"
    if not (isinstance(head, nn.Linear) or _is_lora_linear(head)):
        return f"its head is a {type(head).__name__}, not a linear layer or a LoRA-wrapped one"
    if _is_lora_linear(head) and (getattr(head, "use_dora", {}) and any(head.use_dora.values())
                                  or getattr(head, "lora_variant", None)):
        return "its LoRA head is a variant (DoRA or another) that is not one linear layer"
    if not _reads_loss_function(original_class(model) or type(model)):
        return "its forward computes its loss without self.loss_function"
    loss = getattr(model, "loss_function", None)
    if getattr(loss, "__name__", None) not in LOSSES:
        return f"its loss_function is {getattr(loss, '__name__', loss)!r}, not the causal-LM or masked-LM loss"
    return None


def _looks_like_lm(module: nn.Module) -> bool:
    """An output embedding and a forward taking ``labels``: a language model, fusable or not."""
    return _head_of(module) is not None and "labels" in inspect.signature(type(module).forward).parameters


def fusable_lm_heads(model: nn.Module) -> List[nn.Module]:
    """The heads of the causal LMs in ``model`` that `replace_lm_heads` would fuse (or has fused)."""
    heads = []
    for module in model.modules():
        if isinstance(module, FusedCausalLM):
            heads.append(module.__dict__["_aiak_fused_head"].head)
        elif _looks_like_lm(module) and lm_head_problem(module) is None:
            heads.append(_head_of(module))
    return heads


def _transform_of(model: nn.Module) -> Tuple[Optional[float], Optional[float]]:
    """``(logit_scale, softcap)`` from the model's config: Cohere's ``logit_scale``, Granite's
    ``logits_scaling`` (a divisor), Gemma-2's ``final_logit_softcapping``."""
    config = getattr(model, "config", None)
    scale = getattr(model, "logit_scale", None)
    scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
    divisor = getattr(config, "logits_scaling", None)
    if scale is None and isinstance(divisor, (int, float)) and divisor not in (0, 1):
        scale = 1.0 / float(divisor)
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, float(softcap) if softcap else None


class _Capture:
    """What the head saw in one fused forward: its input and the linear layer it computes."""

    def __init__(self, probe: bool):
        self.probe = probe
        self.hidden: Optional[torch.Tensor] = None
        self.weight: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None
        self.probe_logits: Optional[torch.Tensor] = None
        self.problem: Optional[str] = None


class CapturingHead:
    """Mixin on the head: while its model's fused forward runs, it records its input and returns empty logits
    (``[..., 0]``; on the first call, a few real columns for the transform check); otherwise it is the head."""

    def forward(self, x, *args, **kwargs):
        capture = self.__dict__.get("_aiak_capture")
        if capture is None or args or kwargs:
            return super().forward(x, *args, **kwargs)
        hidden, weight, bias = _as_one_linear(self, x)
        if is_dtensor(weight):
            capture.problem = ("its head's weight is a DTensor (tensor parallelism): the loss needs every class's "
                               "logit on each rank")
            return super().forward(x)
        capture.hidden, capture.weight, capture.bias = hidden, weight, bias
        if capture.probe:
            with torch.no_grad():
                columns = min(PROBE_COLUMNS, capture.weight.shape[0])
                bias = None if capture.bias is None else capture.bias[:columns]
                capture.probe_logits = F.linear(capture.hidden.detach(), capture.weight[:columns].detach(),
                                                None if bias is None else bias.detach())
            return capture.probe_logits
        return x.new_empty(*x.shape[:-1], 0)


def _as_one_linear(head: nn.Module, x: torch.Tensor):
    """``(features, weight, bias)`` of one linear layer computing ``head(x)``: the head's own for a Linear; for
    a LoRA head, ``x`` beside each active adapter's ``scaling * A(dropout(x))``, and ``W`` beside each ``B``."""
    if not _is_lora_linear(head) or getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        base = head.base_layer if _is_lora_linear(head) else head
        return x, base.weight, base.bias
    features, weights = [x], [head.base_layer.weight]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name], head.lora_B[name]
        adapter_x = x.to(a.weight.dtype)
        features.append((a(head.lora_dropout[name](adapter_x)) * head.scaling[name]).to(x.dtype))
        weights.append(b.weight.to(head.base_layer.weight.dtype))
    return torch.cat(features, dim=-1), torch.cat(weights, dim=1), head.base_layer.bias


class _LogitsWhenRead:
    """Mixin on a fused forward's output: ``logits`` is made when read, once, with one warning."""

    @property
    def logits(self):
        made = self.__dict__.get("_aiak_logits")
        if made is None:
            make = self.__dict__.get("_aiak_make_logits")
            if make is None:
                return None
            warn_once("fused_lm_head_logits_read",
                      "fused_ops linear_cross_entropy: the script read outputs.logits in training, so they were "
                      "computed after all and this step's memory saving is lost. Leave linear_cross_entropy out of "
                      "fused_ops for a script that needs the logits of every training step (a distillation loss, "
                      "HF Trainer's label smoothing), or read them only in evaluation")
            made = self.__dict__["_aiak_logits"] = make()
        return made

    @logits.setter
    def logits(self, value):
        self.__dict__["_aiak_logits"] = value

    def __getitem__(self, key):
        if key == "logits":
            return self.logits
        return super().__getitem__(key)


def _with_lazy_logits(out, loss: torch.Tensor, make_logits) -> object:
    """A copy of ``out`` (a ModelOutput) of a subclass whose ``logits`` are made when read, with ``loss`` set: a
    new object rather than a class swap, which torch.compile would not trace."""
    fields = {key: value for key, value in out.items() if key not in ("logits", "loss")}
    cls = swapped_class(type(out), _LogitsWhenRead, "LogitsWhenRead")
    if "logits" in getattr(cls, "__dataclass_fields__", {}):
        # Out of the dataclass's fields, so that code walking an output's fields (FSDP2's post-forward collects
        # the tensors that need gradients) does not make the logits by looking.
        cls.__dataclass_fields__ = {k: v for k, v in cls.__dataclass_fields__.items() if k != "logits"}
    made = cls(loss=loss, **fields)
    made.__dict__["_aiak_make_logits"] = make_logits
    return made


class FusedCausalLM:
    """Mixin on the causal LM: in training with labels and gradients, the loss without the logits."""

    def forward(self, *args, **kwargs):
        plan = self.__dict__.get("_aiak_fused_head")
        if plan is None:
            return super().forward(*args, **kwargs)
        bound = plan.signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        labels = arguments.get("labels")
        extra = (arguments.get(plan.kwargs_name) or {}) if plan.kwargs_name else {}
        return_dict = arguments.get("return_dict", extra.get("return_dict"))
        if return_dict is None:
            return_dict = getattr(getattr(self, "config", None), "return_dict", True)
        if (plan.off or labels is None or not self.training or not torch.is_grad_enabled()
                or return_dict is False):   # a tuple holds the logits in place: they must be made
            return super().forward(*args, **kwargs)
        arguments["labels"] = None
        capture = _Capture(probe=not plan.checked)
        plan.head.__dict__["_aiak_capture"] = capture
        try:
            out = super().forward(*bound.args[1:], **bound.kwargs)
        finally:
            plan.head.__dict__.pop("_aiak_capture", None)
        if not plan.checked and not plan.check(self, out, capture):
            return super().forward(*args, **kwargs)
        hidden = capture.hidden
        ignore_index = extra.get("ignore_index", -100)
        if plan.shift:
            target = extra.get("shift_labels")
            if target is None:
                target = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            features = hidden
        else:
            # A masked LM scores a few tokens in seven: the head's slices run over those alone (a host sync, so
            # not where torch.compile traces; there every token runs, the ignored ones adding nothing).
            target, features = labels, hidden
            if not torch.compiler.is_compiling():
                rows = (target.reshape(-1) != ignore_index).nonzero().squeeze(1)
                features = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
                target = target.reshape(-1).index_select(0, rows)
        loss = linear_cross_entropy(features, capture.weight, target.to(hidden.device), capture.bias, ignore_index,
                                    num_items=extra.get("num_items_in_batch"), logit_scale=plan.logit_scale,
                                    softcap=plan.softcap, implementation=plan.implementation)
        sparse_prediction = not plan.shift and getattr(self, "sparse_prediction", False)

        def make_logits(weight=capture.weight, bias=capture.bias):
            if weight.untyped_storage().size() == 0:     # FSDP2 freed the gathered weight after the forward
                raise RuntimeError("fused_ops linear_cross_entropy: outputs.logits were read after the forward, "
                                   "when the sharded head's gathered weight is already freed: leave "
                                   "linear_cross_entropy out of fused_ops to read the logits in training")
            rows = hidden
            if sparse_prediction:   # ModernBERT's unfused logits are those of the tokens it scores, [scored, vocab]
                keep = labels.reshape(-1) != getattr(self, "sparse_pred_ignore_index", ignore_index)
                rows = hidden.reshape(-1, hidden.shape[-1])[keep.to(hidden.device)]
            return _transform(F.linear(rows, weight, bias), plan.logit_scale, plan.softcap)

        return _with_lazy_logits(out, loss, make_logits)


class _Plan:
    """A fused model's head, its logit transform, and whether the first call's check has run."""

    def __init__(self, model_class: type, head: nn.Module, logit_scale, softcap, implementation: str, shift: bool):
        self.head, self.logit_scale, self.softcap, self.shift = head, logit_scale, softcap, shift
        self.signature = inspect.signature(model_class.forward)
        self.kwargs_name = next((p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD),
                                None)
        self.implementation = implementation
        self.checked = False
        self.off = False

    def check(self, model: nn.Module, out, capture: _Capture) -> bool:
        """The first call: the head must be one the loss can read whole, and the forward must make of the probe's
        logits what `_transform` makes of them."""
        self.checked = True
        problem = capture.problem or self._transform_problem(out, capture)
        if problem is not None:
            self.off = True
            warn(f"fused_ops linear_cross_entropy: {(original_class(model) or type(model)).__name__} runs unfused: "
                 f"{problem}")
        return problem is None

    def _transform_problem(self, out, capture: _Capture) -> Optional[str]:
        made = getattr(out, "logits", None) if not isinstance(out, tuple) else None
        probe = capture.probe_logits
        if capture.hidden is None:
            return "its forward did not call its head with the hidden states alone"
        if not isinstance(made, torch.Tensor) or probe is None or made.shape != probe.shape:
            return "its forward changes the shape of the logits after the head"
        expected = _transform(probe, self.logit_scale, self.softcap)
        tolerance = 4 * torch.finfo(probe.dtype).eps * float(expected.abs().max().clamp(min=1.0))
        if not torch.allclose(made.detach().float(), expected.float(), rtol=0, atol=tolerance):
            return ("its forward transforms the logits after the head in a way aiak does not reproduce "
                    "(known: a config's final_logit_softcapping, logit_scale, logits_scaling)")
        return None


def replace_lm_heads(model: nn.Module, implementation: str = "auto") -> int:
    """Fuse the loss of every language model in `model` with its head, in place, so that no logits are kept.

    What `fused_ops: [linear_cross_entropy]` does to a Hugging Face causal or masked LM: its loss is computed from
    the hidden states a slice of tokens at a time
    ([aiak.ops.linear_cross_entropy][aiak.ops.linear_cross_entropy.linear_cross_entropy]), with the same loss and
    gradients, and only the classes change (parameters and `state_dict` keys stay). A module that looks like a
    language model but cannot be fused exactly is left alone with one warning naming why (`lm_head_problem`).

    Args:
        model: the model itself or a module holding language models.
        implementation: the loss's implementation, as `linear_cross_entropy`'s (`"auto"`, `"chunked"`, `"torch"`,
            `"plain"`).

    Returns:
        How many language models were fused now.
    """
    fused, skipped, inside = 0, [], []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or prefix == "" for prefix in inside):
            continue
        if isinstance(module, FusedCausalLM):
            inside.append(name)
            continue
        if not _looks_like_lm(module):
            continue
        problem = lm_head_problem(module)
        inside.append(name)
        if problem is not None:
            skipped.append(f"{name or '<root>'} ({type(module).__name__}): {problem}")
            continue
        head = _head_of(module)
        logit_scale, softcap = _transform_of(module)
        plan = _Plan(type(module), head, logit_scale, softcap, implementation,
                     shift=LOSSES[module.loss_function.__name__])
        swap_class(head, CapturingHead, "Capturing")
        swap_class(module, FusedCausalLM, "Fused")
        module.__dict__["_aiak_fused_head"] = plan
        fused += 1
        logger.debug("fused linear cross-entropy: %s (%s)", name or "<root>", type(module).__name__)
    if skipped:
        warn(f"linear_cross_entropy: left {len(skipped)} language model(s) unfused: {'; '.join(skipped)}")
    return fused


def restore_lm_heads(model: nn.Module) -> int:
    """Undo [aiak.ops.replace_lm_heads][aiak.ops.lm_head.replace_lm_heads] in place: the models compute their logits
    again.

    Args:
        model: a model fused by `replace_lm_heads` (or a module holding such models).

    Returns:
        How many language models were restored.
    """
    restored: List[nn.Module] = [m for m in model.modules() if isinstance(m, FusedCausalLM)]
    for module in restored:
        plan = module.__dict__.pop("_aiak_fused_head", None)
        if plan is not None:
            restore_class(plan.head)
        restore_class(module)
    return len(restored)
