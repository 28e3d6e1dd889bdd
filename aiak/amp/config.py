"""The ``precision:`` section of a strategy: what `aiak.amp.apply_precision` reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Union

from aiak.util.config import Where, choices

PRECISION_LEVELS = ("O0", "O1", "O2")
PRECISION_DTYPES = ("fp16", "bf16")
FP8_RECIPES = ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class Precision:
    """Mixed precision: O0 fp32, O1 autocast, O2 half-precision compute copies of the fp32 parameters (apex O2's
    numerics; the parameters stay the user's fp32 tensors).

    ``loss_scale`` is ``dynamic``, a positive number (static scale) or ``none`` (no scaling; refused for
    fp16 at O1/O2, where small gradients underflow). ``keep_fp32``: module class names or module paths that O2
    computes in fp32, with their inputs cast for them (`aiak.amp.fp32_modules`); each must name a module of
    the model.

    ``fp8``: torchao's float8 training recipe for the eligible ``nn.Linear`` layers (`aiak.amp.fp8`), the
    rest computing as ``level`` says; ``off`` by default. ``fp8_skip``: layers left in high precision: ``first``
    and ``last`` (the model's first and last ``nn.Linear``), module paths and class names. Whether torchao is
    installed is not a property of the file: a profile naming fp8 loads anywhere; applying it without torchao is
    one error naming the extra (`aiak.amp.fp8.apply_fp8`, before any layer changes), and ``auto`` leaves
    fp8 out there.
    """

    level: str = field(default="O0", metadata=choices(*PRECISION_LEVELS))
    dtype: str = field(default="bf16", metadata=choices(*PRECISION_DTYPES))
    loss_scale: Union[str, float] = field(default="dynamic", metadata=choices("dynamic", "none", also="<positive number>"))
    keep_fp32: List[str] = field(default_factory=list)
    fp8: str = field(default="off", metadata=choices(*FP8_RECIPES))
    fp8_skip: List[str] = field(default_factory=lambda: ["first", "last"])

    def _problems(self, where: Where, path: str) -> List[str]:
        problems = []
        if not isinstance(self.loss_scale, str) and not self.loss_scale > 0:
            problems.append(f"{where(path + 'loss_scale')} must be one of ['dynamic', 'none', '<positive number>'], "
                            f"got {self.loss_scale!r}")
        return problems

    def _combinations(self, where: Where, path: str) -> List[str]:
        """Keys that only work together (judged on the whole strategy, after ``extends`` is merged)."""
        problems = []
        if self.level in ("O1", "O2") and self.dtype == "fp16" and self.loss_scale == "none":
            problems.append(f"{where(path + 'loss_scale')}: fp16 at {self.level} needs loss scaling (small gradients "
                            f"underflow in fp16); set loss_scale to 'dynamic' or a positive number, or use dtype: bf16")
        return problems
