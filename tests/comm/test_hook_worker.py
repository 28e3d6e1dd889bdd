"""The hook pipeline in one process (a one-rank gloo group): int8 recovery, order, errors, worker threads.

The multi-rank numerics (hierarchical == DDP, compression bounds) are in test_hooks.py; here the worker and the
stage code run on real gloo collectives of one rank, which is enough to see what a rank does with its own state.
"""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from aiak.comm import CommState, average
from aiak.comm.allreduce import hooks
from aiak.comm.allreduce.topology import HierarchicalGroups, Topology


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """A one-rank world, with distinct one-rank intra and inter groups for the hierarchical pipeline."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    intra, inter = dist.new_group([0]), dist.new_group([0])
    yield HierarchicalGroups(Topology(0, 1, ((0,),), "test"), intra, inter, (0,), (0,))
    dist.destroy_process_group()


def _aiak_threads():
    return [t for t in threading.enumerate() if t.name == "aiak-comm"]


@pytest.mark.parametrize("hierarchical", [False, True])
def test_int8_after_a_non_finite_bucket_sends_what_it_would_have_sent_without_it(groups, hierarchical):
    """The residuals survive a NaN bucket unchanged: later buckets are bit-identical to a state that never saw it."""
    def state():  # 0.01 MB chunks: the 10001-value bucket crosses in 2 int8 chunks
        return CommState(groups=groups, hierarchical=hierarchical, compression="int8", int8_block=64,
                         pipeline_mb=0.01)

    hit, twin = state(), state()
    torch.manual_seed(0)
    grads = [torch.randn(10001) for _ in range(6)]
    for step, g in enumerate(grads):
        if step == 3:
            bad = g.clone()
            bad[17] = float("nan")
            assert not torch.isfinite(average(hit, bad).wait()).all()
        got, expected = average(hit, g.clone()).wait(), average(twin, g.clone()).wait()
        assert torch.isfinite(got).all(), step
        assert torch.equal(got, expected), step
        assert (got - g).abs().max() > 0  # int8 really ran (one rank: only the quantization changes values)
    residuals = hit.feedback.residuals()
    assert len(residuals) == (4 if hierarchical else 2)  # (local, shard) per bucket or per chunk
    assert all(torch.isfinite(r).all() for r in residuals.values())


def test_buckets_are_issued_in_the_order_they_were_handed_over(groups, monkeypatch):
    sizes = []
    original = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)  # records the real collective, as the deadlock guard wraps it
    state = CommState(compression="fp16")
    futures = [average(state, torch.full((n,), float(n))) for n in range(1, 40)]
    results = torch.futures.wait_all(futures)
    assert sizes == list(range(1, 40))
    assert all(torch.equal(r, torch.full((n,), float(n))) for n, r in zip(range(1, 40), results))


def test_a_failing_stage_fails_its_future_and_the_next_bucket_still_runs(groups):
    state = CommState(compression="int8")
    with pytest.raises(Exception):
        average(state, torch.ones(4, 4)).wait()  # int8 takes 1-D buckets only
    assert torch.equal(average(state, torch.full((8,), 2.0)).wait(), torch.full((8,), 2.0))


def test_worker_threads_exit_when_idle_and_start_again(groups, monkeypatch):
    monkeypatch.setattr(hooks, "IDLE_EXIT_S", 0.2)
    assert not _aiak_threads() or _wait_for_no_threads(10.0)
    states = [CommState(compression="bf16") for _ in range(20)]
    torch.futures.wait_all([average(s, torch.ones(16)) for s in states])
    assert len(_aiak_threads()) <= 20  # one per state at most (some may have exited already)
    assert _wait_for_no_threads(5.0), f"{len(_aiak_threads())} worker threads still alive"
    assert torch.equal(average(states[0], torch.ones(16)).wait(), torch.ones(16))  # a new thread picks it up
    assert _wait_for_no_threads(5.0)


def _wait_for_no_threads(seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _aiak_threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_comm_worker_computes_on_one_intra_op_thread():
    """Its casts and compression run beside the step's compute: on one intra-op thread, starting no OpenMP team that
    would throttle the training loop's (aiak.util.background_threads); the caller's count is untouched."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen, done = [], threading.Event()
        hooks._Worker().submit(lambda: (seen.append(torch.get_num_threads()), done.set()))
        assert done.wait(timeout=30)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
