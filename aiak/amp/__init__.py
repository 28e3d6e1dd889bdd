"""Mixed precision: AMP O1 (autocast) and O2 (half-precision compute copies of the fp32 parameters), loss scaling,
a script's own ``GradScaler`` beside them, and warnings for precisions the device only emulates.

The TF32 switch, which the public contract lists under ``aiak.amp``, lives with the other process switches in
`aiak.runtime.switches` and is handed on here; nothing in aiak imports it from here."""
from aiak.amp.emulation import emulation_warning
from aiak.amp.half_compute import HalfCompute
from aiak.amp.scaling.loss_scaler import LossScaler
from aiak.amp.precision import PrecisionState, apply_precision
from aiak.runtime.switches import apply_tf32

__all__ = ["HalfCompute", "LossScaler", "PrecisionState", "apply_precision", "apply_tf32", "emulation_warning"]
