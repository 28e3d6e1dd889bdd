"""Deadlock guard on 4 gloo ranks: misordered and missing collectives become errors on every rank."""
import pytest
from torch.testing import assert_close

pytestmark = pytest.mark.slow
TIMEOUT = 4.0  # the guard's timeout in dist_worker.scenario_deadlock


@pytest.fixture(scope="module")
def results(launch_ranks):
    return launch_ranks("deadlock", timeout=120)


def test_guarded_ddp_step_gives_the_same_gradients(results):
    for r in results:
        got, expected = r["guarded_grads"]
        for a, b in zip(got, expected):
            assert_close(a, b, rtol=0, atol=2e-3 * float(b.abs().max()))  # hierarchical + fp16


def test_misordered_collectives_raise_on_every_rank(results):
    for rank, r in enumerate(results):
        message, elapsed = r["misordered"]
        assert "collective #0" in message and "differs across ranks" in message, message
        assert "rank 0: all_reduce(float32[10])" in message and "rank 2: broadcast(float32[10])" in message
        assert "ranks [2, 3]" in message
        assert elapsed < TIMEOUT  # found by comparing fingerprints, not by waiting


def test_a_missing_rank_is_named_within_the_timeout(results):
    waiting = [r["late"][1] for rank, r in enumerate(results) if rank != 3]
    assert max(waiting) >= TIMEOUT  # the first rank to give up waited its whole timeout...
    for rank, r in enumerate(results):
        message, elapsed = r["late"]
        assert "rank(s) [3] did not reach it" in message, message
        if rank != 3:  # ...and the others heard from it at about the same moment (their clocks started a bit later)
            assert TIMEOUT - 1 <= elapsed < TIMEOUT + 3
        else:  # arrives after its sleep, finds the abort note instead of entering the collective
            assert elapsed < TIMEOUT + 2 + 3
