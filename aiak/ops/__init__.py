"""Fused operators and the module surgery that puts them into existing models.

* `window_attention` - fused Swin window attention (Triton on CUDA, one SDPA call elsewhere).
* `replace_window_attention` - swaps known Swin window-attention modules for fused ones in place.
* `linear_cross_entropy` - the loss of a linear head without its logits (chunked, or torch's own op).
* `replace_lm_heads` - fuses that loss into Hugging Face causal and masked LMs in place (`restore_lm_heads` undoes it).
* `replace_pointwise_convs` - computes every 1x1 convolution as one matrix multiply in place
  (`restore_pointwise_convs` undoes it).
* `apply_fused_ops` - what ``aiak.optimize()`` calls for the strategy's ``fused_ops`` list.

Importing this package needs only torch; triton is imported on the first CUDA (or interpreter) call.
"""
from aiak.ops.surgery import FUSED_OPS, apply_fused_ops, replace_window_attention, restore_window_attention
from aiak.ops.linear_cross_entropy import linear_cross_entropy
from aiak.ops.lm_head import replace_lm_heads, restore_lm_heads
from aiak.ops.pointwise_conv import replace_pointwise_convs, restore_pointwise_convs
from aiak.ops.window_attention import window_attention

__all__ = ["window_attention", "replace_window_attention", "restore_window_attention", "linear_cross_entropy",
           "replace_lm_heads", "restore_lm_heads", "replace_pointwise_convs", "restore_pointwise_convs",
           "apply_fused_ops", "FUSED_OPS"]
