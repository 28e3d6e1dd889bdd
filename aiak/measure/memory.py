"""What one piece of work adds to memory at its peak, above what was held before it.

On CUDA, the caching allocator's peak (``torch.cuda.max_memory_allocated``, reset at the start) over what was
allocated at the start. On a CPU, the process's resident high-water mark: Linux resets it on request (writing
``5`` to ``/proc/self/clear_refs`` sets ``VmHWM`` to the resident size now), and ``VmHWM`` after the work, less
the resident size before it, is what the work added at its peak. It is exact where every tensor is an ``mmap``
of its own that goes back to the kernel on free: a fresh process with ``MALLOC_MMAP_THRESHOLD_=65536`` in its
environment, as `benchmarks/linear_cross_entropy.py` measures. In a long-lived process it is a lower bound: glibc
serves a request from freed heap memory that is still resident when it has room (a 128 MiB tensor once read 0 in
a test process of the suite), and that adds nothing to the figure. Elsewhere (no ``/proc``, or a kernel that
refuses the reset), None: a figure that would include the peaks of earlier work is not given.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["PeakMemory"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


class PeakMemory:
    """``with PeakMemory(device) as peak: work()``, then ``peak.bytes``: the work's peak above its start (None
    where it cannot be measured)."""

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bytes: Optional[int] = None
        self._start: Optional[int] = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._start = _resident_bytes()
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        try:
            self.bytes = max(_high_water_bytes() - self._start, 0)
        except OSError:
            self.bytes = None

    @property
    def mib(self) -> Optional[float]:
        return None if self.bytes is None else self.bytes / 2 ** 20
