"""glibc malloc's thresholds, fixed so that a training step reuses the memory the previous one freed.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a block from its heap below a threshold
and maps fresh pages for a larger one (``mmap``), unmapped again when freed; and it gives the top of its heap back
to the system once more than another threshold of it is free (trimming). Both thresholds adapt: each rises to the
size of the largest mapped block freed so far, up to 32 MiB (trimming at twice that). A training step frees its
activations and gradients and the next allocates them again: what was unmapped or trimmed is faulted in page by
page, zeroed by the kernel, every step. On this project's 2-core CPU a plain training step of seven of
``benchmarks/auto.py``'s eight models took 5,100 to 17,800 minor page faults (``getrusage``) and ran 1.03-1.21x
slower than with the thresholds fixed (``benchmarks/separate_processes.py``, each side in processes of its own,
since a process cannot turn glibc's adapting back on); the eighth, an MLP, never paged.

``malloc_retain: true`` fixes them with ``mallopt`` (glibc's manual, "Malloc Tunable Parameters"): blocks up to
32 MiB (the largest threshold glibc accepts on a 64-bit system) from the heap, and up to `RETAINED_BYTES` of free
heap kept for reuse instead of trimmed. Nothing computed changes. The process keeps, at most, memory it held a
moment before. This is what preloading tcmalloc or jemalloc does for PyTorch's CPU performance guides, without a
preload: ``mallopt`` takes effect in the running process.

The setting is a process switch (`aiak.runtime.switches.process_switches`), read as whether aiak fixed the
thresholds. Turned off again (the rollback of a failed ``optimize()``), glibc cannot adapt any more: the thresholds
are fixed at the ceiling of its adapting (32 MiB, trimming above 64 MiB), the most any untouched process reaches.
So a comparison inside one process cannot show this knob's gain: the timing engine (`aiak.measure.rounds`: ``aiak
demo``, ``aiak bench``) runs every contender with the setting as it is, plain PyTorch too once a strategy turned it
on, and a speedup timed there leaves it out.

Elsewhere (musl, macOS, Windows) ``mallopt`` does not exist: the knob warns once and is skipped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform
from typing import Any, Optional

from aiak.util.warn import warn_once

M_TRIM_THRESHOLD = -1       # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_CEILING = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)   # DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64 bits
TRIM_CEILING = 2 * MMAP_CEILING                                  # what glibc's adapting sets beside it
RETAINED_BYTES = 1 << 30    # free heap kept for reuse (at most a sixteenth of the machine's memory)

_retaining = False          # whether aiak fixed the thresholds for reuse (`read`)


@functools.lru_cache(maxsize=None)
def _glibc() -> Optional[Any]:
    """glibc's ``mallopt``, or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        library = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        library.mallopt.argtypes, library.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return library


def retained_bytes() -> int:
    """The free heap `malloc_retain` keeps: `RETAINED_BYTES`, at most a sixteenth of the physical memory."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 16 * RETAINED_BYTES
    return max(TRIM_CEILING, min(RETAINED_BYTES, physical // 16))


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    library = _glibc()
    return (library is not None and library.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
            and library.mallopt(M_TRIM_THRESHOLD, min(trim_threshold, 2 ** 31 - 1)) == 1)


def read() -> bool:
    """Whether aiak fixed glibc's thresholds for reuse (the process switch ``malloc_retain``)."""
    return _retaining


def write(on: bool) -> None:
    """Fix the thresholds for reuse, or at glibc's ceiling (see the module docstring); no-op without glibc."""
    global _retaining
    if bool(on) == _retaining:
        return
    if _set(MMAP_CEILING, retained_bytes() if on else TRIM_CEILING):
        _retaining = bool(on)


def apply_malloc_retain(enabled: bool, device: Any) -> str:
    """The knob ``malloc_retain``; returns what was done, for the summary."""
    if not enabled:
        return "off"
    if _glibc() is None:
        warn_once("malloc_retain", f"aiak: malloc_retain needs glibc's malloc (Linux); this process's C library is "
                                   f"{platform.libc_ver()[0] or platform.system()}: skipped. Preloading tcmalloc or "
                                   f"jemalloc (LD_PRELOAD) keeps freed memory for reuse there")
        return "skipped (not glibc)"
    write(True)
    if not _retaining:
        return "skipped (mallopt refused the thresholds)"
    return (f"on (glibc malloc: blocks up to {MMAP_CEILING >> 20} MiB from the heap, up to "
            f"{retained_bytes() >> 20} MiB of freed memory kept for reuse)")
