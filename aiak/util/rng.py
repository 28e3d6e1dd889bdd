"""The process's global random streams, saved and put back as one: torch's CPU generator (and CUDA's, when
asked), Python's ``random`` and NumPy's legacy global generator (only when NumPy is already imported; reading
it never imports NumPy). CUDA is touched only with ``cuda=True``.
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator

import torch


class GlobalRng:
    """The global random streams as they were when this was made."""

    __slots__ = ("torch", "cuda", "python", "numpy")

    def __init__(self, cuda: bool = False):
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")
        self.numpy = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)

    def same_as(self, other: "GlobalRng") -> bool:
        """Every stream in the same state (CUDA's compared only where both hold it)."""
        return (torch.equal(self.torch, other.torch) and self.python == other.python
                and _same_numpy(self.numpy, other.numpy)
                and (self.cuda is None or other.cuda is None
                     or all(torch.equal(a, b) for a, b in zip(self.cuda, other.cuda))))


@contextlib.contextmanager
def preserved(cuda: bool = False) -> Iterator[GlobalRng]:
    """The global random streams are put back on exit, whatever ran inside drew."""
    saved = GlobalRng(cuda)
    try:
        yield saved
    finally:
        saved.restore()


def _same_numpy(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    np = sys.modules["numpy"]
    return len(a) == len(b) and all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                                    for x, y in zip(a, b))
