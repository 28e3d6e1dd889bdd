"""fp8 matrix multiplication in a model's linear layers, with torchao's float8 training recipes.

On GPUs with fp8 tensor cores (CUDA compute capability 8.9 and newer: Ada, Hopper, Blackwell) the matrix
multiplications of the forward and both backward products can run in fp8 with per-tensor or per-row scales,
the recipes of torchao's float8 training (``torchao.float8``; Micikevicius et al., "FP8 Formats for Deep
Learning", 2022, for e4m3/e5m2 and scaled casts):

* ``tensorwise``: one dynamic scale per tensor, e4m3 for the inputs, weights and gradients; the fastest;
* ``rowwise``: a scale per row (per column of the weight), more accurate with outliers;
* ``rowwise_with_gw_hp``: rowwise, with the weight-gradient product kept in high precision.

`apply_fp8` converts the eligible ``nn.Linear`` layers of a model in place by swapping their class for
``Float8<Name>`` (`aiak.runtime.class_swap`): the module's ``forward`` becomes torchao's float8 matmul, fed
with the module's own ``weight`` and ``bias`` read at every call. So the parameters stay the user's fp32 tensors
(an O2 region's half copies when one is open), ``state_dict()`` keys and dtypes are those of the plain model, hooks
registered on the layer still run, and copies compute the same way. torchao's own conversion
(``convert_to_float8_training``) builds new modules instead, which would lose hooks and attributes set on the
layers. Only the float8 autograd function and the config objects come from torchao.

Eligible: an ``nn.Linear`` that is not parametrized and whose class keeps ``nn.Linear.forward``, with both
dimensions multiples of 16 (what the fp8 GEMM accepts), outside ``nn.MultiheadAttention`` (which reads its
projection weights without calling them), outside modules kept in fp32 (`aiak.amp.fp32_modules`), and not
named by ``precision.fp8_skip``.
That list defaults to ``[first, last]``, the model's first and last ``nn.Linear`` in registration order, since
torchao advises keeping those in high precision. It also takes module paths and class names.

torchao's float8 backward cannot be differentiated again: a backward with ``create_graph=True`` (a gradient
penalty) through a converted layer is refused at once, naming the layer and ``precision.fp8_skip``.

Where the device has no fp8 tensor cores (a CPU, a GPU below 8.9) torchao emulates the casts and products:
numerically the same recipe and slow, which `aiak.amp.emulation` warns about once. This is how the tests
run it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from aiak.amp.config import FP8_RECIPES
from aiak.amp.emulation import native_fp8
from aiak.amp.fp32_modules import is_kept_fp32, modules_named
from aiak.runtime.class_swap import original_class, swap_class
from aiak.runtime.marks import mark, marked

logger = logging.getLogger("aiak")

RECIPES = FP8_RECIPES[1:]   # after "off"
EDGES = ("first", "last")
FP8_EXTRA = "pip install 'aiak[fp8]' (torchao)"
# What fp8 trades, said by `aiak explain`. Measured in tests/amp/test_fp8.py (a 64->256 Linear layer, random
# weights and inputs, output SQNR against fp32): 28.7-29.0 dB for the three recipes, 51.1 dB for bf16.
TRADES = ("throughput of the linear layers' matrix multiplications on fp8 tensor cores, for precision: about "
          "22 dB less output SQNR than bf16 (29 dB against fp32 where bf16 gives 51; e4m3 keeps 3 mantissa bits)")


def torchao_problem() -> Optional[str]:
    """Why torchao's float8 training cannot be used here (None: it can)."""
    if importlib.util.find_spec("torchao") is None:
        return f"needs torchao, which is not installed: {FP8_EXTRA}"
    try:
        _float8()
    except (ImportError, AttributeError) as e:
        import torchao

        return (f"needs torchao's float8 training (torchao.float8: Float8LinearConfig.from_recipe_name, "
                f"float8_linear.matmul_with_hp_or_float8_args), which torchao {torchao.__version__} lacks ({e}): "
                f"{FP8_EXTRA}")
    return None


def _float8():
    """torchao's float8 module and its autograd function. torch logs a deprecation at its first import (an Enum
    registered with pytree), which says nothing to the user: that logger is quieted for the import."""
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        from torchao import float8
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    finally:
        pytree_log.setLevel(level)
    return float8.Float8LinearConfig, Float8Linear, matmul_with_hp_or_float8_args


_SPECS: Dict[Tuple[str, bool], tuple] = {}


def _spec(recipe: str, emulate: bool) -> tuple:
    """``(Float8LinearConfig, LinearMMConfig, the float8 autograd function)`` of a recipe, built once; the
    ``LinearMMConfig`` as torchao's ``Float8Linear`` builds it (on the meta device, never used to compute)."""
    key = (recipe, emulate)
    if key not in _SPECS:
        config_class, float8_linear, matmul = _float8()
        config = dataclasses.replace(config_class.from_recipe_name(recipe), emulate=emulate)
        mm_config = float8_linear(16, 16, bias=False, config=config, device="meta").linear_mm_config
        _SPECS[key] = (config, mm_config, matmul)
    return _SPECS[key]


class _FirstOrderOnly(torch.autograd.Function):
    """The identity on a converted layer's output, whose backward refuses to be recorded for a second derivative.
    torchao's float8 backward is not differentiable: a gradient penalty (``torch.autograd.grad(...,
    create_graph=True)``, WGAN-GP, R1) through an fp8 layer would fail later inside torchao with an error about
    float8 tensor types. Grad mode is on inside a backward exactly when ``create_graph=True``, so this says at once
    which layer and what to do."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, path: str) -> torch.Tensor:
        ctx.path = path
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"aiak: the Linear layer {ctx.path!r} computes in fp8 (precision.fp8), and a backward with "
                "create_graph=True (a gradient penalty: WGAN-GP, R1) runs through it; torchao's float8 backward "
                "cannot be differentiated again. Name the layers the penalty flows through in precision.fp8_skip "
                "(module paths or class names), or set precision.fp8: off")
        return grad, None


class Float8Compute:
    """The mixin in front of a converted layer's class: its forward is torchao's float8 matmul of the input with
    the layer's weight, plus its bias. The recipe is the layer's ``_aiak_fp8`` mark."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        recipe, emulate, path = marked(self, "_aiak_fp8")
        config, mm_config, matmul = _spec(recipe, emulate)
        device_type = input.device.type
        if torch.is_autocast_enabled(device_type):  # autocast does not reach into the float8 function
            input = input.to(torch.get_autocast_dtype(device_type))
        output = matmul.apply(input, self.weight.t(), mm_config, config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return _FirstOrderOnly.apply(output, path) if torch.is_grad_enabled() else output


@dataclass
class Fp8Plan:
    """Which linear layers compute in fp8, and why each other one does not."""

    recipe: str
    emulated: bool = False
    converted: List[str] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)   # (module path, reason)

    def describe(self) -> str:
        text = (f"fp8 {self.recipe} in {len(self.converted)} Linear layer(s) ({len(self.skipped)} left in high "
                "precision)")
        return text + (" (emulated: slow)" if self.emulated else "")

    def detail(self) -> str:
        """Each layer left in high precision with its reason (``aiak explain``; the converted ones are counted)."""
        kept = "; ".join(f"{path} ({why})" for path, why in self.skipped) or "none"
        return f"{len(self.converted)} Linear layer(s) in fp8 {self.recipe}; left in high precision: {kept}"


def _named(path: str) -> str:
    return path or "<root>"


def _inside(path: str, prefixes: Sequence[str]) -> bool:
    return any(p == "" or path == p or path.startswith(p + ".") for p in prefixes)


def plan_fp8(model: nn.Module, recipe: str, skip: Sequence[str] = EDGES) -> Fp8Plan:
    """What `apply_fp8` would convert, without torchao. An entry of ``skip`` other than ``first`` and
    ``last`` names modules as ``precision.keep_fp32`` does (`modules_named`: a class
    name or a module path, else one ``StrategyError``); the layers inside them stay in high precision."""
    modules = dict(model.named_modules())
    named = {id(m) for m in modules_named(model, [s for s in skip if s not in EDGES], "precision.fp8_skip")}
    named_paths = [p for p, m in modules.items() if id(m) in named]
    attention = [p for p, m in modules.items() if isinstance(m, nn.MultiheadAttention)]
    kept = [p for p, m in modules.items() if is_kept_fp32(m)]
    linears = [p for p, m in modules.items() if isinstance(m, nn.Linear)]
    edges = {"first": linears[:1], "last": linears[-1:]}
    plan = Fp8Plan(recipe)
    for path in linears:
        module = modules[path]
        cls = original_class(module) or type(module)
        reason = None
        if parametrize.is_parametrized(module):
            reason = "parametrized (torch.nn.utils.parametrize): its weight is computed anew at every read"
        elif cls.forward is not nn.Linear.forward:
            reason = f"{cls.__name__} has a forward of its own"
        elif _inside(path, attention):
            reason = "inside nn.MultiheadAttention, which reads its weights without calling the layer"
        elif module.in_features % 16 or module.out_features % 16:
            reason = f"{module.in_features}x{module.out_features}: fp8 GEMMs need both dimensions multiples of 16"
        elif _inside(path, kept):
            reason = "kept in fp32 (precision.keep_fp32 or a normalization layer)"
        else:
            for word in EDGES:
                if word in skip and path in edges[word]:
                    reason = f"the model's {word} Linear; precision.fp8_skip: {word}"
            if reason is None and _inside(path, named_paths):
                reason = "named by precision.fp8_skip"
        if reason is None:
            plan.converted.append(path)
        else:
            plan.skipped.append((_named(path), reason))
    return plan


def apply_fp8(model: nn.Module, recipe: str, skip: Sequence[str], device: torch.device) -> Fp8Plan:
    """Convert the eligible linear layers of ``model`` to ``recipe`` in place (emulated where ``device`` has no
    fp8 tensor cores); returns the plan, every layer left alone with its reason."""
    if recipe not in RECIPES:
        raise ValueError(f"precision.fp8: {recipe!r} is not a recipe; valid choices: {['off', *RECIPES]}")
    problem = torchao_problem()
    if problem is not None:
        raise ImportError(f"aiak: precision.fp8 {recipe!r} {problem}")
    plan = plan_fp8(model, recipe, skip)
    plan.emulated = not native_fp8(device)
    _spec(recipe, plan.emulated)  # torchao imported and the recipe built before any layer changes
    modules = dict(model.named_modules())
    for path in plan.converted:
        module = modules[path]
        mark(module, "_aiak_fp8", (recipe, plan.emulated, path))
        if original_class(module) is None:
            swap_class(module, Float8Compute, "Float8")
    logger.info("aiak: %s; kept: %s", plan.describe(),
                "; ".join(f"{p} ({why})" for p, why in plan.skipped) or "none")
    return plan
