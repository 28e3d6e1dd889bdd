"""Tiny models for ``test_conformance.py``: each does one thing real training scripts do with a model.

Sizes are a handful of features on purpose: fp16 and bf16 are emulated on a CPU and slow.
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

FEAT, HID, CLASSES = 16, 16, 3


class AuxNet(nn.Module):
    """Keeps an auxiliary loss on the module (MoE load-balancing loss, deep supervision): ``aux_head`` is reached
    by the aux loss only."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(FEAT, HID)
        self.aux_head = nn.Linear(HID, 4)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        self.aux_loss = (self.aux_head(h) ** 2).mean()
        return self.head(h)


class BlockNet(nn.Module):
    """stem -> block -> head; ``block`` is what a distillation hook, a checkpoint or a state_dict hook targets."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.block = nn.Sequential(nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, HID))
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.block(torch.tanh(self.stem(x)))))


class Critic(nn.Module):
    """A WGAN critic / R1 discriminator: smooth activations, so the gradient penalty has second-order terms."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), nn.Linear(HID, HID), nn.SiLU(), nn.Linear(HID, 1))

    def forward(self, x):
        return self.net(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh())

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(HID, CLASSES)

    def forward(self, h):
        return self.net(h)


class EmaCodebook(nn.Module):
    """VQ-VAE with an EMA codebook: a frozen ``nn.Parameter`` updated in place under no_grad inside forward."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(FEAT, 4)
        self.codebook = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        z = self.enc(x)
        if self.training:
            with torch.no_grad():
                self.codebook.mul_(0.9).add_(0.1 * z.detach().mean(0))
        return self.head(z + self.codebook)


class Counted(nn.Module):
    """A module (not a norm layer) that counts the samples it has seen in a float buffer."""

    def __init__(self, reassign):
        super().__init__()
        self.lin = nn.Linear(FEAT, HID)
        self.register_buffer("seen", torch.zeros(()))
        self.reassign = reassign

    def forward(self, x):
        if self.training:
            if self.reassign:
                self.seen = self.seen + x.shape[0]
            else:
                self.seen += x.shape[0]
        return self.lin(x)


class CountingNet(nn.Module):
    def __init__(self, reassign):
        super().__init__()
        self.stem = Counted(reassign)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.stem(x)))


class ScaledTriu(nn.Module):
    """A custom parametrization with a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, w):
        return w.triu() * self.scale


def parametrized_net(kind):
    """``lin.weight`` parametrized by ``kind`` (weight_norm, spectral_norm, custom)."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("lin", nn.Linear(FEAT, FEAT))
    net.add_module("act", nn.Tanh())
    net.add_module("head", nn.Linear(FEAT, CLASSES))
    if kind == "weight_norm":
        parametrizations.weight_norm(net.lin)
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(net.lin)
    else:
        parametrize.register_parametrization(net.lin, "weight", ScaledTriu())
    return net


class Bomb(nn.Module):
    """Raises ``armed`` (KeyboardInterrupt, SystemExit) from inside its forward when set: a Ctrl-C, a preemption
    signal handler that exits."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HID, HID)
        self.armed = None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.armed is not None:
            raise self.armed
        return h


class BombNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.bomb = Bomb()
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(self.bomb(torch.tanh(self.stem(x))))


class BNNet(nn.Module):
    """A classifier with BatchNorm: eval mode changes what it computes."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, HID), nn.BatchNorm1d(HID), nn.ReLU(), nn.Linear(HID, CLASSES))

    def forward(self, x):
        return self.net(x)


class Spectral(nn.Module):
    """FFT features (FNet, spectral mixing): ``torch.fft.rfft`` has no half kernel on a CPU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HID, HID)

    def forward(self, h):
        return torch.fft.rfft(self.lin(h), dim=-1).abs()


class SpectralNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.mix = Spectral()
        self.head = nn.Linear(HID // 2 + 1, CLASSES)

    def forward(self, x):
        return self.head(self.mix(torch.tanh(self.stem(x))))


class CheckpointNet(nn.Module):
    """``torch.utils.checkpoint`` around a block inside the forward."""

    def __init__(self, use_reentrant):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.block = nn.Sequential(nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, HID))
        self.head = nn.Linear(HID, CLASSES)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(torch.tanh(h))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES))

    def forward(self, x):
        return self.net(x)


class HookedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(FEAT, HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


VOCAB = 10


class TiedLM(nn.Module):
    """Input embedding tied to the output head, and the tied weight also read by the parent's forward
    (``F.linear(h, self.emb.weight)``), as GPT-2/T5 style heads do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HID)
        self.body = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.body(self.emb(idx))).mean(1)
        return self.head(h) + F.linear(h, self.emb.weight)


class ReusedNet(nn.Module):
    """One module called twice in one forward (weight sharing across depth, ALBERT-style)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.block = nn.Sequential(nn.Linear(HID, HID), nn.Tanh())
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(self.block(self.block(torch.tanh(self.stem(x)))))


class LazyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.LazyLinear(HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


class WithSpare(nn.Module):
    """``spare`` is not used by the forward (a head of another phase): only a penalty on the parameters reaches
    it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), nn.Linear(HID, CLASSES))
        self.spare = nn.Linear(CLASSES, CLASSES)

    def forward(self, x):
        return self.net(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), nn.Linear(HID, CLASSES))

    def forward(self, x):
        return self.net(x)


# -- ops autocast keeps out of half precision (rows 26-31) ---------------------------------------------------------

class InvertibleMix(nn.Module):
    """Glow's invertible 1x1 convolution (Kingma & Dhariwal, 2018, section 3.2) on features: ``z = x W^T`` and the
    log-determinant ``slogdet(W)`` added to the loss; the inverse ``W^-1`` maps the output back for a
    reconstruction term. ``slogdet`` and ``inverse`` have no half kernel here; plain autocast runs them on the fp32
    weight."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(HID, HID))[0] + 0.1 * torch.randn(HID, HID))

    def forward(self, x):
        z = x @ self.weight.t()
        self.logdet = torch.slogdet(self.weight)[1]
        self.back = z @ torch.inverse(self.weight).t()
        return z


class FlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.mix = InvertibleMix()
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        z = self.mix(h)
        self.aux_loss = -0.01 * self.mix.logdet + ((self.mix.back - h) ** 2).mean()
        return self.head(torch.tanh(z))


class QuantileNorm(nn.Module):
    """Robust scaling by a quantile of the activations (``torch.quantile``, in autocast's fp32 list on a CPU)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = self.stem(x)
        q = torch.quantile(h.abs(), 0.9, dim=1, keepdim=True)
        return self.head(torch.tanh(h / (q + 1e-3)))


class ComplexRotary(nn.Module):
    """Rotary embedding through complex numbers (LLaMA's ``apply_rotary_emb`` without its ``.float()``):
    ``view_as_complex`` of a half activation, which autocast runs in fp32 on a CPU."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.head = nn.Linear(HID, CLASSES)
        angles = torch.arange(HID // 2).float() / HID
        self.register_buffer("freqs", torch.polar(torch.ones(HID // 2), angles), persistent=False)

    def forward(self, x):
        h = self.stem(x)
        rotated = torch.view_as_real(torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2)) * self.freqs)
        return self.head(torch.tanh(rotated.flatten(-2).type_as(h)))


class RouterNet(nn.Module):
    """A mixture of experts whose router is fed ``h.float()`` (Switch Transformer's selective precision, Fedus et
    al., 2021, section 2.4) and whose mixing weights come out of an fp32 softmax."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.router = nn.Linear(HID, 4)
        self.experts = nn.ModuleList(nn.Linear(HID, HID) for _ in range(4))
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        gates = self.router(h.float()).float().softmax(-1)
        mixed = sum(gates[:, i:i + 1] * expert(h) for i, expert in enumerate(self.experts))
        return self.head(torch.tanh(mixed))


class MaskedLinear(nn.Module):
    """An autoregressive (MADE) layer: an fp32 mask built in ``forward`` times the weight of a ``Linear``."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.lin = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        mask = torch.ones(HID, HID, device=x.device).tril()
        return self.head(torch.tanh(F.linear(h, self.lin.weight * mask, self.lin.bias)))


class PerceptualNet(nn.Module):
    """A perceptual loss: a frozen feature net kept outside the module tree (``self.__dict__``, so neither
    ``parameters()`` nor ``state_dict()`` sees it) is called on the model's features inside ``forward``."""

    def __init__(self, features: nn.Module):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.head = nn.Linear(HID, CLASSES)
        self.__dict__["features"] = features

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        self.aux_loss = (self.features(h) ** 2).mean()
        return self.head(h)


def frozen_features():
    net = nn.Sequential(nn.Linear(HID, HID), nn.ReLU(), nn.Linear(HID, HID))
    return net.requires_grad_(False)


class MatrixExpNet(nn.Module):
    """A rotation learned through its generator: ``matrix_exp(A - A^T)`` on the weight alone (``torch.linalg``;
    ``parametrizations.orthogonal`` does the same), with no half kernel on a CPU."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.generator = nn.Parameter(0.5 * torch.randn(HID, HID))
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        rotation = torch.linalg.matrix_exp(self.generator - self.generator.t())
        return self.head(h @ rotation)


def orthogonal_net():
    from torch.nn.utils.parametrizations import orthogonal

    net = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), orthogonal(nn.Linear(HID, HID)), nn.Tanh(),
                        nn.Linear(HID, CLASSES))
    return net


# -- edits through .data inside forward (rows 32-33) ---------------------------------------------------------------

MAX_NORM = 0.25


class ConstrainedLinear(nn.Linear):
    """EEGNet's max-norm constraint (Lawhern et al., 2018): ``self.weight.data = torch.renorm(...)`` before each
    forward; ``nonnegative`` clamps in place instead (``self.weight.data.clamp_(min=0)``)."""

    def __init__(self, *args, nonnegative=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.nonnegative = nonnegative
        self.register_buffer("level", torch.zeros(self.out_features))

    def forward(self, x):
        if self.nonnegative:
            self.weight.data.clamp_(min=0)
        else:
            self.weight.data = torch.renorm(self.weight.data, p=2, dim=0, maxnorm=MAX_NORM)
        out = super().forward(x)
        self.level.data = 0.9 * self.level.data + 0.1 * out.detach().float().mean(0)
        return out


class ConstrainedNet(nn.Module):
    def __init__(self, nonnegative=False):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID)
        self.lin = ConstrainedLinear(HID, HID, nonnegative=nonnegative)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.stem(x)))))


class MaxNormEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)``: each forward renormalizes, in place, the rows it looks up whose norm exceeds
    ``max_norm`` (here some rows do, most do not, and most rows are never looked up)."""

    def __init__(self, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, HID, max_norm=4.5)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens).mean(1)))


# -- fp16 loss scaling through reentrant checkpoints (rows 34-35) --------------------------------------------------

class LoraBlock(nn.Module):
    """A frozen ``Linear`` with a trainable low-rank adapter beside it (LoRA, Hu et al., 2021)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(HID, HID).requires_grad_(False)
        self.down = nn.Linear(HID, 4, bias=False)
        self.up = nn.Linear(4, HID, bias=False)

    def forward(self, h):
        return torch.tanh(self.base(h) + self.up(self.down(h)))


def _input_requires_grad(module, args, output):
    output.requires_grad_(True)  # what Hugging Face's enable_input_require_grads() hooks on the embeddings


class CheckpointedLora(nn.Module):
    """PEFT's LoRA recipe with ``gradient_checkpointing_enable(use_reentrant=True)``: the stem and head frozen, the
    stem's output made to require grad, every block checkpointed reentrantly, so every trainable parameter computes
    inside a checkpoint and the outer backward reaches none of them."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(FEAT, HID).requires_grad_(False)
        self.blocks = nn.ModuleList(LoraBlock() for _ in range(3))
        self.head = nn.Linear(HID, CLASSES).requires_grad_(False)
        self.stem.register_forward_hook(_input_requires_grad)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.head(h)
