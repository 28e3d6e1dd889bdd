"""Stand-ins for the user's data sets: learnable, made on the spot from a seed, nothing downloaded.

Replace them with your own ``Dataset``; the training scripts only need what a ``DataLoader`` needs. Each has a
``held_out`` split: other samples of the same classes, for a validation loss.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

SPLITS = ("train", "held_out")


def _generators(seed: int, split: str):
    """``(classes, samples)``: the classes depend only on the seed, the samples on the seed and the split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return torch.Generator().manual_seed(seed), torch.Generator().manual_seed(2 * seed + 1 + SPLITS.index(split))


class SyntheticImages(Dataset):
    """``(image, label)`` pairs: each class is a fixed random pattern, plus one of 64 fixed noise images (cheap to
    serve at any size, so the loader is not what gets measured)."""

    def __init__(self, n: int, image_size: int, num_classes: int, seed: int = 0, split: str = "train"):
        classes, samples = _generators(seed, split)
        self.patterns = torch.randn(num_classes, 3, image_size, image_size, generator=classes)
        self.noise = 0.8 * torch.randn(64, 3, image_size, image_size, generator=samples)
        self.labels = torch.randint(0, num_classes, (n,), generator=samples)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        label = self.labels[i]
        return self.patterns[label] + self.noise[(i * 7919) % len(self.noise)], label


class SyntheticText(Dataset):
    """``(tokens, label)`` pairs of variable length, like sentences: lengths are long-tailed (log-normal, between
    ``min_len`` and ``max_len``), so random batches are mostly padding. Each class has its own 16 "topic"
    tokens, and a third of a sequence's tokens come from its class's topic: a mean of token embeddings can
    learn it. Token 0 is the padding token and never occurs in a sequence.

    ``lengths`` (one int per sample) lets ``aiak`` balance batches without reading every sample first.
    """

    PAD = 0

    def __init__(self, n: int, vocab: int, num_classes: int, min_len: int, max_len: int, seed: int = 0,
                 split: str = "train"):
        classes, samples = _generators(seed, split)
        self.topics = torch.randperm(vocab - 1, generator=classes)[:num_classes * 16].view(num_classes, 16) + 1
        median = (min_len * max_len) ** 0.5 / 2
        lengths = (torch.randn(n, generator=samples) * 0.8).exp() * median
        self.lengths = lengths.clamp(min_len, max_len).long().tolist()
        self.labels = torch.randint(0, num_classes, (n,), generator=samples)
        self.vocab, self.seed = vocab, int(torch.randint(0, 2**31, (1,), generator=samples))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed + i)   # sample i is the same on every read
        length, label = self.lengths[i], self.labels[i]
        tokens = torch.randint(1, self.vocab, (length,), generator=g)
        on_topic = torch.rand(length, generator=g) < 1 / 3
        tokens[on_topic] = self.topics[label][torch.randint(0, 16, (int(on_topic.sum()),), generator=g)]
        return tokens, label
