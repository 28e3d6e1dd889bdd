"""The ``loader:`` section of a strategy: prefetching, pinned memory, balanced batches, on-device normalisation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from aiak.util.config import Where


@dataclass
class LoaderConfig:
    """Loader wrapping: ``prefetch`` batches kept ready by a background thread (0 = off), pinned host memory,
    length-balanced batches across ranks (optionally with a token budget per rank and step), and on-device
    normalization of uint8 images by the prefetcher (``mean``/``std`` in [0, 1] units, one value per channel).
    """

    prefetch: int = 0
    pin_memory: bool = False
    balanced: bool = False
    max_tokens: Optional[int] = None
    mean: Optional[List[float]] = None
    std: Optional[List[float]] = None

    def _problems(self, where: Where, path: str) -> List[str]:
        problems = []
        if self.prefetch < 0:
            problems.append(f"{where(path + 'prefetch')} must be >= 0 (0 turns prefetching off), got {self.prefetch}")
        return problems

    def _combinations(self, where: Where, path: str) -> List[str]:
        """Keys that only work together (judged on the whole strategy, after ``extends`` is merged)."""
        problems = []
        if (self.mean is None) != (self.std is None) or (self.mean and len(self.mean) != len(self.std)):
            problems.append(f"{where(path + 'mean')} and loader.std go together, one value per channel each")
        if self.mean is not None and self.prefetch == 0:
            problems.append(f"{where(path + 'mean')}/std need loader.prefetch >= 1 (the prefetcher normalizes)")
        if self.max_tokens is not None and (self.max_tokens < 1 or not self.balanced):
            problems.append(f"{where(path + 'max_tokens')} needs loader.balanced: true and a value >= 1")
        if self.pin_memory and self.prefetch == 0:
            problems.append(f"{where(path + 'pin_memory')} needs loader.prefetch >= 1 (pinning happens in the "
                            f"prefetcher)")
        return problems
