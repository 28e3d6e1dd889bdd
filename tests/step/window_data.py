"""Data, models and plain-PyTorch references shared by the window tests and their ranks
(``test_window_ends_and_items.py``, ``window_worker.py``)."""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

VOCAB = 11


def token_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


def rank_batches(rank: int, world: int, n: int = 8, size: int = 2) -> List[Dict[str, torch.Tensor]]:
    """``n`` micro-batches of ``size`` sequences of 1 to 14 tokens, padded; padding's labels are -100 (ignored),
    so the micro-batches hold from a few to a few dozen real tokens."""
    g = torch.Generator().manual_seed(100 + rank * 7 + world)
    batches = []
    for _ in range(n):
        lengths = torch.randint(1, 15, (size,), generator=g)
        longest = int(lengths.max())
        ids = torch.randint(0, VOCAB, (size, longest), generator=g)
        labels = torch.randint(0, VOCAB, (size, longest), generator=g)
        for row, length in enumerate(lengths.tolist()):
            labels[row, length:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def count_tokens(batch) -> torch.Tensor:
    return (batch["labels"] != -100).sum()


def token_loss(model: nn.Module, batch, reduction: str = "mean") -> torch.Tensor:
    """The mean (or sum) of the cross-entropy over the batch's real tokens."""
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                       reduction=reduction)


def big_batch_run(model: nn.Module, optimizer, windows: Sequence[Sequence[dict]], clip: float = 1e9) -> None:
    """Plain PyTorch: one step per window, on the mean over all the window's real tokens (one big batch)."""
    for window in windows:
        tokens = sum(int(count_tokens(b)) for b in window)
        loss = sum(token_loss(model, b, "sum") for b in window) / tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()


def mean_of_means_run(model: nn.Module, optimizer, windows: Sequence[Sequence[dict]]) -> None:
    """Plain PyTorch accumulation of per-micro-batch means, each divided by the window's micro-batches."""
    for window in windows:
        for b in window:
            (token_loss(model, b) / len(window)).backward()
        optimizer.step()
        optimizer.zero_grad()


def image_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def samples(n: int = 80) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def windows_of(batches: Sequence, accumulation: int) -> List[List]:
    """timm's rule: windows of ``accumulation`` batches, the epoch's last one holding what is left."""
    return [list(batches[i:i + accumulation]) for i in range(0, len(batches), accumulation)]


def epoch_run(model: nn.Module, optimizer, epochs: Sequence[Sequence], accumulation: int) -> None:
    """Plain PyTorch on ``epochs`` (each a list of ``(x, y)`` batches): windows closed at each epoch's end, each
    micro-batch's mean loss divided by its window's micro-batches."""
    for batches in epochs:
        for window in windows_of(batches, accumulation):
            for x, y in window:
                (nn.functional.cross_entropy(model(x), y) / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad()
