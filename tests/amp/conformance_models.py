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
