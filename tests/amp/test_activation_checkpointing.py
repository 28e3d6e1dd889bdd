"""Activation checkpointing recomputes a forward inside the backward pass: under O1/O2 the recomputed blocks
take the role they had in the forward (inside the region, or at its boundary for a checkpointed model), so the
gradients equal those of the same model without checkpointing, bit for bit."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import aiak


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    """Three residual blocks and a head; ``mode`` checkpoints each block (None: no checkpointing)."""

    def __init__(self, mode=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)
        self.mode = mode

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.mode == "reentrant") if self.mode else block(x)
        return self.head(x)


def _grads(strategy, mode):
    torch.manual_seed(0)
    model = Net(mode if mode != "whole model" else None)
    model, _, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).requires_grad_()  # reentrant checkpointing needs an input with grad
    y = torch.randint(0, 4, (8,), generator=g)
    out = checkpoint(model, x, use_reentrant=False) if mode == "whole model" else model(x)
    nn.functional.cross_entropy(out, y).backward()
    return [p.grad for p in model.parameters()] + [x.grad]


@pytest.mark.filterwarnings("ignore:aiak. precision.dtype")
@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "whole model"])
@pytest.mark.parametrize("level,dtype", [("O2", "bf16"), ("O2", "fp16"), ("O1", "bf16"), ("O1", "fp16")])
def test_checkpointed_gradients_equal_the_plain_forwards(level, dtype, mode):
    strategy = {"precision": {"level": level, "dtype": dtype}}
    reference, checkpointed = _grads(strategy, None), _grads(strategy, mode)
    assert all(g is not None for g in checkpointed)
    for a, b in zip(reference, checkpointed):
        assert torch.equal(a, b)
