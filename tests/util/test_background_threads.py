"""aiak's background threads compute on one intra-op thread, and change no other thread's count."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from aiak.util.background_threads import compute_on_one_thread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def in_thread(body):
    """Run ``body`` in a new thread and return what it returned."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=body()))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    return out["value"]


def parallel_op() -> torch.Tensor:
    """An op ATen splits across its intra-op threads (far above its grain size)."""
    x = torch.arange(1 << 20, dtype=torch.float32)
    return (x * 2).sum()


def test_the_calling_thread_alone_computes_on_one_thread(two_threads):
    def body():
        held = compute_on_one_thread()
        return held, torch.get_num_threads(), float(parallel_op())

    held, threads, total = in_thread(body)
    assert held and threads == 1, (held, threads)
    assert total == float(parallel_op())                 # the same result on one thread
    assert torch.get_num_threads() == 2                  # the caller's count is untouched ...
    assert in_thread(torch.get_num_threads) == 2         # ... and so is a thread started afterwards


def _tasks() -> set:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the process's threads in /proc")
def test_a_confined_thread_starts_no_openmp_team_of_its_own(two_threads):
    """A thread that runs a parallel op keeps an OpenMP team of torch's thread count alive beside the training loop's
    (under ATen's OpenMP backend); a confined one adds no thread but itself."""
    parallel_op()   # the main thread's own team exists before counting

    def new_threads(confine: bool) -> set:
        ran, done = threading.Event(), threading.Event()
        ident = {}

        def body():
            ident["tid"] = str(threading.get_native_id())
            if confine:
                compute_on_one_thread()
            parallel_op()
            ran.set()
            done.wait(timeout=30)

        before = _tasks()
        thread = threading.Thread(target=body)
        thread.start()
        assert ran.wait(timeout=30)
        added = _tasks() - before - {ident["tid"]}
        done.set()
        thread.join(timeout=30)
        return added

    if not new_threads(confine=False):
        pytest.skip("torch's parallel ops start no thread team per calling thread here (not the OpenMP backend)")
    assert new_threads(confine=True) == set()
