"""Module surgery: put fused window attention into existing Swin models, in place; the registry of ``fused_ops``.

Policies in the style of Composer's module surgery: each policy recognises one implementation by class
name and structure (never by importing its library) and names the fused forward that replaces it
(`aiak.ops.swin_fused`). The swap changes only the module's class, to ``Fused<Name>``, a subclass
of the original with the fused ``forward`` in front (`aiak.runtime.class_swap`): parameters (the same
``nn.Parameter`` objects), buffers and ``state_dict`` keys are untouched, so an optimizer created before surgery
still holds the right tensors. Surgery refuses models already wrapped (DDP, DataParallel, torch.compile) and warns (rank 0, at the
user's line: `aiak.util.warn`) about variants it cannot fuse exactly (SwinV2 cosine attention) and about
modules whose attention dropout makes training fall back to the original forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Collection, Dict, FrozenSet, Iterable, List, Optional, Tuple

from torch import nn

from aiak.ops import swin_fused
from aiak.ops.lm_head import replace_lm_heads
from aiak.ops.pointwise_conv import pointwise_convs, replace_pointwise_convs
from aiak.runtime.class_swap import original_class, restore_class, swap_class
from aiak.util.warn import warn

__all__ = ["FUSED_OPS", "replace_window_attention", "restore_window_attention", "apply_fused_ops",
           "is_window_attention", "SWITCHED_OPS", "NEUTRAL_FUSED_OPS", "FusedOpsSwitch"]

logger = logging.getLogger("aiak")

FUSED_OPS = ("window_attention", "linear_cross_entropy", "pointwise_conv")
# The fused ops that compute the same products with another kernel, as a layout does (a 1x1 convolution as one matrix
# multiply: gradients equal to the convolution's within fp32 rounding on every architecture its tests train), so the
# numerics gate does not judge them (`aiak.tune.gate`); the others replace a computation (fused attention, a loss
# taken a slice at a time) and are gated.
NEUTRAL_FUSED_OPS = ("pointwise_conv",)


@dataclass(frozen=True)
class _Policy:
    name: str                                   # said in logs
    matches: Callable[[nn.Module], bool]
    fused: type                                 # the mixin put in front of the original class
    dropout: Callable[[nn.Module], float]       # attention dropout probability (fused only when 0 or eval)
    always_falls_back: bool = False             # dropout > 0 runs the original forward in every mode


def _has(module: nn.Module, *names: str) -> bool:
    return all(hasattr(module, n) for n in names)


def _is_linear(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _is_cosine_attention(module: nn.Module) -> bool:
    # SwinV2 (all implementations): cosine similarity with a learned logit scale, bias from an MLP.
    return any(hasattr(module, name) for name in ("logit_scale", "cpb_mlp", "continuous_position_bias_mlp"))


def _is_plain_window_bias(module: nn.Module) -> bool:
    """Swin's bias: an [N, N] index into a [(2Wh-1)(2Ww-1), H] table, and nothing else added to q/k/v.

    Rejects look-alikes such as BEiT attention (class-token rows in the table, separate q/v biases)."""
    if hasattr(module, "q_bias") or hasattr(module, "v_bias"):
        return False
    window = getattr(module, "window_size", None)
    if isinstance(window, int):
        window = (window, window)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        return False
    wh, ww = int(window[0]), int(window[1])
    table, index = module.relative_position_bias_table, module.relative_position_index
    return (index.numel() == (wh * ww) ** 2 and table.dim() == 2
            and table.shape[0] == (2 * wh - 1) * (2 * ww - 1)
            and table.shape[1] == getattr(module, "num_heads", getattr(module, "num_attention_heads", None)))


def _dropout_p(module: Optional[nn.Module]) -> float:
    return module.p if isinstance(module, nn.Dropout) else 0.0


_POLICIES = (
    _Policy(
        "Hugging Face transformers 5.x SwinAttention",
        lambda m: (_is_linear(m, "q_proj", "k_proj", "v_proj", "o_proj") and _has(m, "head_dim", "scaling")
                   and _has(getattr(m, "relative_position_bias", None), "relative_position_bias_table",
                            "relative_position_index")),
        swin_fused.FusedHFSwinAttention,
        lambda m: float(getattr(m, "attention_dropout", 0.0) or 0.0),
    ),
    _Policy(
        "Hugging Face transformers 4.x SwinSelfAttention",
        lambda m: (_is_linear(m, "query", "key", "value")
                   and _has(m, "relative_position_bias_table", "relative_position_index",
                            "num_attention_heads", "attention_head_size", "all_head_size")
                   and _is_plain_window_bias(m)),
        swin_fused.FusedHFSwinSelfAttention,
        lambda m: _dropout_p(getattr(m, "dropout", None)),
    ),
    _Policy(
        "torchvision ShiftedWindowAttention",
        lambda m: (type(m).__name__ == "ShiftedWindowAttention" and _is_linear(m, "qkv", "proj")
                   and _has(m, "window_size", "shift_size", "num_heads", "get_relative_position_bias")),
        swin_fused.FusedTorchvisionShiftedWindowAttention,
        lambda m: max(float(getattr(m, "attention_dropout", 0.0)), float(getattr(m, "dropout", 0.0))),
        always_falls_back=True,
    ),
    _Policy(
        "Swin WindowAttention (original Swin-Transformer code / timm)",
        lambda m: (_is_linear(m, "qkv", "proj") and _has(m, "relative_position_bias_table",
                                                          "relative_position_index", "num_heads")
                   and not hasattr(m, "shift_size") and _is_plain_window_bias(m)),
        swin_fused.FusedQKVWindowAttention,
        lambda m: _dropout_p(getattr(m, "attn_drop", None)),
    ),
)

def is_window_attention(module: nn.Module) -> bool:
    """True for a module that looks like Swin window attention, fusable or not (SwinV2 included): one holding a
    ``relative_position_bias_table`` parameter itself, or a class named ``*Attention*`` with a
    ``relative_position_bias`` submodule or SwinV2's cosine-attention parameters. Broader than the fusing
    policies: surgery uses it to warn about look-alikes it leaves alone, and the auto-selector's model probe
    (`aiak.strategy.probes`) counts window-attention modules with it."""
    return ("relative_position_bias_table" in dict(module.named_parameters(recurse=False))
            or hasattr(module, "relative_position_bias") and "Attention" in type(module).__name__
            or _is_cosine_attention(module) and "Attention" in type(module).__name__)


def _check_bare(model: nn.Module, what: str) -> None:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        raise TypeError(f"{what}: the model is already wrapped in {type(model).__name__}; module surgery must run "
                        "on the bare model before any wrapping (aiak.optimize() does this in the right order)")
    if hasattr(model, "_orig_mod"):
        raise TypeError(f"{what}: the model is already compiled (torch.compile); run surgery on the bare model first")


def replace_window_attention(model: nn.Module) -> int:
    """Swap every known Swin window-attention module in `model` for its fused form, in place.

    What `fused_ops: [window_attention]` does: each module keeps its parameters, buffers and `state_dict` keys and
    only its class changes, so [aiak.ops.window_attention][aiak.ops.window_attention.window_attention] computes the
    attention. Recognised: Hugging Face transformers `SwinAttention` (5.x) and `SwinSelfAttention` (4.x), timm and
    the original Swin-Transformer `WindowAttention` (by structure: `qkv`, `relative_position_bias_table`,
    `relative_position_index`, `proj`), torchvision `ShiftedWindowAttention`. SwinV2 cosine attention and unknown
    look-alikes are left alone with a warning naming them.

    Args:
        model: the bare model (before DDP or `torch.compile`).

    Returns:
        How many modules were swapped now (modules fused before are not counted again).

    Raises:
        TypeError: `model` is not a `torch.nn.Module`, or is already wrapped in DDP / DataParallel or compiled
            (surgery runs on the bare model first).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_window_attention: model must be a torch.nn.Module, got {type(model).__name__}")
    _check_bare(model, "replace_window_attention")
    replaced, skipped, eval_only = 0, [], []
    handled = []  # prefixes of modules fused or skipped: their children are part of them
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") or (prefix == "" and name) for prefix in handled):
            continue
        if original_class(module) is not None:
            handled.append(name)
            continue
        label = f"{name or '<root>'} ({type(module).__name__})"
        if _is_cosine_attention(module) and is_window_attention(module):
            skipped.append(f"{label}: SwinV2 cosine attention with a learned logit scale")
            handled.append(name)
            continue
        policy = next((p for p in _POLICIES if p.matches(module)), None)
        if policy is None:
            if is_window_attention(module):
                skipped.append(f"{label}: unrecognised window-attention structure")
                handled.append(name)
            continue
        if policy.dropout(module) > 0:
            if policy.always_falls_back:
                skipped.append(f"{label}: dropout p={policy.dropout(module)}")
                handled.append(name)
                continue
            eval_only.append(f"{label} p={policy.dropout(module)}")
        swap_class(module, policy.fused, "Fused")
        handled.append(name)
        replaced += 1
        logger.debug("fused window attention: %s as %s", label, policy.name)
    if skipped:
        warn(f"window_attention: left {len(skipped)} module(s) unfused because they cannot be fused exactly: "
             f"{'; '.join(skipped)}")
    if eval_only:
        warn(f"window_attention: {len(eval_only)} module(s) use attention dropout, so they run fused only in eval "
             f"mode and fall back to their original forward while training: {', '.join(eval_only)}")
    return replaced


def restore_window_attention(model: nn.Module) -> int:
    """Undo `replace_window_attention` in place; returns how many modules were restored."""
    return sum(restore_class(module) for module in model.modules() if _is_fused(module))


class FusedOpsSwitch:
    """The modules of one model that `SWITCHED_OPS` swapped, switchable between two steps: `switch` gives each its
    original class or its swapped one again (the same modules, parameters, buffers and hooks; nothing is looked for
    again, so nothing is warned again). The trials' switched copy and the run-time guard time a pick with and without
    its fused ops this way (`aiak.tune.guard`)."""

    def __init__(self, model: nn.Module):
        found = {op: _SWITCHED[op](model) for op in SWITCHED_OPS}
        self.modules: Dict[str, List[Tuple[nn.Module, type]]] = {
            op: [(m, type(m)) for m in modules] for op, modules in found.items() if modules}
        self.on = self.ops

    @property
    def ops(self) -> FrozenSet[str]:
        """The ops this model can switch (those the pick applied and that replaced something)."""
        return frozenset(self.modules)

    def switch(self, ops: Collection[str]) -> None:
        """The modules of each op in ``ops`` compute swapped, the others with their original forward, from their
        next call (ops this model cannot switch are ignored)."""
        wanted = self.ops & frozenset(ops)
        for op, modules in self.modules.items():
            if (op in wanted) != (op in self.on):
                for module, swapped in modules:
                    if op in wanted:
                        module.__class__ = swapped
                    else:
                        restore_class(module)
        self.on = wanted


def _is_fused(module: nn.Module) -> bool:
    return isinstance(module, tuple(p.fused for p in _POLICIES))


# The fused ops whose modules only change class, so a model computes with or without them from one step to the next
# (`FusedOpsSwitch`), each with the function that finds its swapped modules in a model; the fused language-model head
# changes the loss the model returns and is built, not switched.
_SWITCHED: Dict[str, Callable[[nn.Module], List[nn.Module]]] = {
    "window_attention": lambda model: [m for m in model.modules() if _is_fused(m)],
    "pointwise_conv": pointwise_convs}
SWITCHED_OPS = tuple(_SWITCHED)

_APPLIERS: Dict[str, Callable[[nn.Module], int]] = {"window_attention": replace_window_attention,
                                                    "linear_cross_entropy": replace_lm_heads,
                                                    "pointwise_conv": replace_pointwise_convs}


def apply_fused_ops(model: nn.Module, names: Iterable[str]) -> Dict[str, int]:
    """Apply the strategy's ``fused_ops`` to the bare ``model``; returns ``{name: modules replaced}``.

    A name that replaced nothing warns and is skipped; an unknown
    name raises ``ValueError`` listing the valid choices; a model wrapped in DistributedDataParallel
    (or DataParallel / torch.compile) raises ``TypeError``.
    """
    if isinstance(names, str):
        names = [names]
    names = list(names)
    unknown = [n for n in names if n not in _APPLIERS]
    if unknown:
        raise ValueError(f"fused_ops: unknown op(s) {unknown}; valid choices: {list(FUSED_OPS)}")
    _check_bare(model, "apply_fused_ops")
    counts = {}
    for name in dict.fromkeys(names):
        counts[name] = _APPLIERS[name](model)
        if counts[name] == 0:
            warn(f"fused_ops: {name} replaced nothing in {type(model).__name__} (no known module to fuse); skipped")
    return counts
