"""The built-in demo: a small CNN with BatchNorm trained on synthetic images, baseline vs optimized.

Used by ``aiak demo`` (train both and compare), ``aiak bench`` (time both) and ``aiak explain`` (what a
strategy applies to this model). CPU-sized by default: the whole demo runs in well under a minute.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DemoNet(nn.Module):
    """Conv-BN-ReLU x3 with stride, global pooling and a linear head (ResNet-like stem, tiny)."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()

        def block(cin, cout, stride):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.features = nn.Sequential(block(3, width, 1), block(width, 2 * width, 2), block(2 * width, 4 * width, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def synthetic_dataset(n: int = 2048, image_size: int = 32, num_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Learnable synthetic images: each class is a fixed random pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 3, image_size, image_size, generator=g)
    return TensorDataset(images, labels)


@dataclass
class RunResult:
    name: str
    steps: int
    samples: int
    seconds: float                 # the training loop
    final_loss: float
    setup_seconds: float = 0.0     # aiak.optimize() before it (the trials of strategy "auto" included)

    @property
    def throughput(self) -> float:
        """Samples per second over the loop and its setup: aiak's tuning cost is paid out of its speedup."""
        total = self.seconds + self.setup_seconds
        return self.samples / total if total > 0 else float("nan")


def make_setup(seed: int = 0, n: int = 2048, batch_size: int = 64, lr: float = 0.05, width: int = 32):
    torch.manual_seed(seed)
    model = DemoNet(width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    loader = DataLoader(synthetic_dataset(n, seed=seed), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed), drop_last=True)
    return model, optimizer, loader


def train(model, optimizer, loader, epochs: int = 1, name: str = "", progress: Optional[Callable] = None,
          device: Any = "cpu") -> RunResult:
    """A plain training loop, exactly what a user writes; aiak never asks for a different one."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    steps = samples = 0
    loss = torch.zeros(())
    start = time.perf_counter()
    total = epochs * len(loader)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            samples += x.shape[0]
            if progress is not None:
                progress(name, steps, total, loss)
    seconds = time.perf_counter() - start
    return RunResult(name, steps, samples, seconds, float(loss.detach()))


def progress_bar(name: str, step: int, total: int, loss: torch.Tensor, width: int = 30, stream=sys.stderr) -> None:
    if step != total and step % max(1, total // 50):
        return
    filled = int(width * step / total)
    stream.write(f"\r  {name:<10} [{'#' * filled}{'.' * (width - filled)}] {step}/{total}  loss {float(loss):.4f}")
    if step == total:
        stream.write("\n")
    stream.flush()


def run_demo(strategy: Any = "auto", epochs: int = 2, n: int = 2048, batch_size: int = 64, show_progress: bool = True,
             seed: int = 0):
    """Train the demo model twice from the same initial weights: plain PyTorch, then ``aiak.optimize``."""
    import aiak

    progress = progress_bar if show_progress else None
    model, optimizer, loader = make_setup(seed, n, batch_size)
    init = copy.deepcopy(model.state_dict())
    baseline = train(model, optimizer, loader, epochs, "baseline", progress)

    model, optimizer, loader = make_setup(seed, n, batch_size)
    model.load_state_dict(init)
    start = time.perf_counter()
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
    setup = time.perf_counter() - start
    optimized = train(model, optimizer, loader, epochs, "aiak", progress)
    optimized.setup_seconds = setup
    return baseline, optimized
