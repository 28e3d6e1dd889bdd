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


def _llama_adapters(seed=0):
    """A tiny Hugging Face Llama trained the LoRA way: everything frozen but the attention's query and value
    projections (all inside the decoder layers), ``enable_input_require_grads()`` and reentrant gradient
    checkpointing, as PEFT's recipe sets them up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("q_proj.weight", "v_proj.weight")))
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


@pytest.mark.filterwarnings("ignore:aiak. precision.dtype")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_lora_with_reentrant_checkpointing_gets_plain_amps_gradients(level):
    """fp16, loss weighted 1e-5: plain autocast with a GradScaler (2**16) gives the adapters' true gradients; so must
    aiak's loss scaling, though no trainable parameter is in the graph the outer backward walks (before, it ran
    unscaled: every adapter gradient exactly 0). Cosine >= 0.99 and norms within 10% per parameter (fp16 rounding in
    both runs, O2 computing more in half than autocast)."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    plain = _llama_adapters()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = 1e-5 * plain(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.1)
    scaler.unscale_(opt)

    model = _llama_adapters()
    trained = [p for p in model.parameters() if p.requires_grad]
    model, _, _ = aiak.optimize(model, torch.optim.SGD(trained, lr=0.1),
                                strategy={"precision": {"level": level, "dtype": "fp16", "loss_scale": 2.0 ** 16}})
    (1e-5 * model(input_ids=ids, labels=ids).loss).backward()
    expected = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        want = expected[name].grad
        assert want is not None and want.any(), name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), want.flatten(), dim=0)
        ratio = p.grad.norm() / want.norm()
        assert cos >= 0.99 and 0.9 <= ratio <= 1.1, f"{name}: cosine {float(cos):.4f}, norm ratio {float(ratio):.4f}"
