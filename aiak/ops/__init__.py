"""Fused operators and the module surgery that puts them into existing models.

* :func:`window_attention` - fused Swin window attention (Triton on CUDA, one SDPA call elsewhere).
* :func:`replace_window_attention` - swaps known Swin window-attention modules for fused ones in place.
* :func:`apply_fused_ops` - what ``aiak.optimize()`` calls for the strategy's ``fused_ops`` list.

Importing this package needs only torch; triton is imported on the first CUDA (or interpreter) call.
"""
from aiak.ops.surgery import FUSED_OPS, apply_fused_ops, replace_window_attention, restore_window_attention
from aiak.ops.window_attention import window_attention

__all__ = ["window_attention", "replace_window_attention", "restore_window_attention", "apply_fused_ops", "FUSED_OPS"]
