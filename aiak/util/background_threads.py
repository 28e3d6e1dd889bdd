"""aiak's own background threads (the prefetcher, the comm worker): what each must do beside the training loop.

**Its torch ops run on one intra-op thread** (`compute_on_one_thread`, called first in each thread). Under ATen's
OpenMP backend (torch's Linux builds), every OS thread that runs a parallel op (a ``torch.stack`` in a loader's
collate, a ``channels_last`` copy of a batch, a cast in a comm hook) gets an OpenMP team of its own, of torch's
thread count, kept until the thread exits. libgomp counts the threads of every team; once they outnumber the cores,
every OpenMP thread of the process, the training loop's included, stops spinning for new work after about a hundred
tries instead of about three hundred thousand (``GOMP_SPINCOUNT``'s throttled value) and sleeps, so each parallel
region of the training step pays a futex wake-up. Measured on 2 cores (torch 2.14, timm's ResNet-50 at 32 px, batch
16): a plain model's step went from 155 ms to 246 ms, and stayed there, once a prefetching thread had laid out one
batch channels_last; with that thread on one intra-op thread, 157 ms. A background thread that loads or packs a
batch has no use for the training loop's cores anyway: they are busy computing.

**It leaves torch's C++ code before the interpreter finalizes** (`stop_at_exit`). aiak's daemon threads call into
torch with the GIL released: a gloo collective's ``wait()``, ``Future.set_result``, a loader's ``next()``. A daemon
thread that takes the GIL back after finalization has begun is ended with ``pthread_exit``; its forced unwinding
crosses pybind11's GIL guard, a ``noexcept`` destructor, and the whole process aborts ("terminate called without an
active exception", SIGABRT), so torchrun reports a rank that finished its work as failed. The window is the last
bucket's ``set_result``: the training loop sees the future done and the script exits while the worker is still
returning from C++. Owners registered here are stopped by one ``atexit`` handler, which Python runs before
finalization; each ``stop_for_exit()`` lets its thread finish what it is doing and joins it, with a bound.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import weakref
from typing import Callable, Optional

import torch

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()

OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")   # GNU's (torch's Linux wheels), Intel's, LLVM's


def compute_on_one_thread() -> bool:
    """From now on, the calling thread's torch ops run on one intra-op thread, and it starts no OpenMP team of its own
    (see the module docstring); the training loop's threads keep theirs. Returns whether that holds: False where
    torch's OpenMP runtime cannot be reached (then nothing was changed)."""
    if torch.get_num_threads() == 1:   # (ATen's first call in a thread sets its OpenMP count: done now, before ours)
        return True
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return False
    set_threads(1)   # the calling thread's own setting (OpenMP's nthreads-var); torch.set_num_threads would also
    #                  change the count threads started later read, clear oneDNN's cache and resize a shared pool
    return torch.get_num_threads() == 1


@functools.lru_cache(maxsize=None)
def _omp_set_num_threads() -> Optional[Callable[[int], None]]:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded: the one mapped from torch's own folder first, then
    whichever the process's global symbols give; None without one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:   # not Linux
        paths = set()
    torch_dir = os.path.dirname(torch.__file__)
    candidates = sorted((p for p in paths if os.path.basename(p).startswith(OPENMP_RUNTIMES)),
                        key=lambda p: not p.startswith(torch_dir))
    candidates.append(None)   # the process's global symbols (macOS, or a runtime not found in the maps)
    for path in candidates:
        try:
            function = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], None
        return function
    return None


def stop_at_exit(owner) -> None:
    """Call ``owner.stop_for_exit()`` at interpreter exit, if ``owner`` is still alive then."""
    _OWNERS.add(owner)


def _stop_all() -> None:
    for owner in list(_OWNERS):
        try:
            owner.stop_for_exit()
        except Exception:  # noqa: BLE001 - exiting anyway; one owner's failure must not skip the others
            pass


atexit.register(_stop_all)
