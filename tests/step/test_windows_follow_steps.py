"""Accumulation windows and counted items follow the steps the script takes, not the batches the returned loader
hands out: on 2x2 gloo ranks, loops that read the loader other than "one batch, one step" give plain DDP's result.

Each rank trains two epochs of 10 token batches, ``grad_accumulation: 4`` (windows of 4, 4 and 2 batches, timm's
rule), SGD with momentum. The reference is one process taking each window's step on every rank's micro-batches of
that window: the mean over all the window's tokens (counted) or the mean of the micro-batches' means (not counted),
which is what plain DDP computes. Weights to 1e-6 (float32 sums in another order). The loops
(``tests/step/window_worker.py``, ``one_loop``): an evaluation over the training loader between the epochs, a
prefetcher that reads one batch ahead (apex's ``data_prefetcher``), a second epoch from a loader the script made
itself (said once; refused with ``count_items=fn``, whose function that loader never calls), and the script's own
accumulation (``no_sync``) with ``aiak.count_items`` before each backward. Before the windows followed the
steps, they failed 7 of the 8 cases: the evaluation 0.079 (counted) and 0.090 off, the prefetcher 0.079 off
(counted: an error blaming the script), the new loader 0.064 off and, counted, 0.062 off with no error (the
function silently stopped being called), the script's own counted accumulation 0.395 off (only the last count was
used)."""
import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import aiak
from tests.step import window_data as data

WORLD, EPOCHS, BATCHES = 4, 2, 10


def _reference(counted: bool):
    per_rank = [data.rank_batches(r, WORLD, n=BATCHES) for r in range(WORLD)]
    windows = [[b for r in range(WORLD) for b in per_rank[r][w:w + 4]] for w in range(0, BATCHES, 4)] * EPOCHS
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    (data.big_batch_run if counted else data.mean_of_means_run)(model, opt, windows)
    return model.state_dict()


def _off(state, reference) -> float:
    return max((state[k] - reference[k]).abs().max().item() for k in reference)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_loops_that_read_the_loader_their_own_way_match_plain_ddp():
    from tests.comm.conftest import launch

    cases = ["eval:fn", "eval:none", "ahead:fn", "ahead:none", "own:fn", "own:none", "fresh:none", "fresh:fn"]
    env = {"AIAK_TEST_STRATEGY": json.dumps({"tune": False}), "AIAK_TEST_LOOPS": ",".join(cases)}
    ranks = launch("loops", Path(tempfile.mkdtemp()), world=WORLD, env=env, timeout=300,
                   worker=Path(__file__).with_name("window_worker.py"))
    references = {True: _reference(True), False: _reference(False)}
    assert _off(references[True], references[False]) > 1e-3  # counting changes the result: the test can fail
    for rank, results in enumerate(ranks):
        for case in cases[:-1]:
            result, counted = results[case], case.endswith(":fn")
            assert result["error"] is None, (rank, case, result["error"])
            off = _off(result["state"], references[counted])
            assert off < 1e-6, f"rank {rank}, {case}: {off:.2g} from plain DDP"
        foreign = [s for s in results["fresh:none"]["said"] if "did not hand out" in s]
        assert len(foreign) == (rank == 0), results["fresh:none"]["said"]  # (said once, by rank 0)
        assert not any("did not hand out" in s for case in cases[:6] for s in results[case]["said"])
        error = results["fresh:fn"]["error"]
        assert error is not None and "did not hand out" in error and "count_items=True" in error, error


def _token_run(batches, strategy, loop, count=None):
    model = data.token_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt, loader = aiak.optimize(model, opt, batches, count_items=count, strategy={"tune": False, **strategy})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        stepped = loop(model, opt, loader)
    return model, stepped, [str(w.message) for w in said if "aiak" in str(w.message)]


def test_an_epoch_left_early_starts_the_next_epochs_count_and_is_said(warnings_said_again):
    """A loop that leaves its first epoch after 6 of 10 batches: the window open there (2 micro-batches) runs on into
    the second epoch, whose steps are counted from its first, so its last step closes a window (timm's rule) and the
    weights are those of plain PyTorch with the same windows (1e-6). Said once."""
    batches = data.rank_batches(0, 1, n=10)

    def loop(model, opt, loader):
        stepped = []
        for epoch in range(2):
            for i, batch in enumerate(loader):
                if epoch == 0 and i == 6:
                    break
                data.token_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
                stepped.append(aiak.stepped(opt))
        return stepped

    model, stepped, said = _token_run(batches, {"grad_accumulation": 4}, loop)
    assert stepped == [False, False, False, True, False, False] + [False, True, False, False, False, True] + \
        [False, False, False, True]
    assert len([s for s in said if "ended after 6 steps" in s]) == 1, said
    reference = data.token_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    windows = [batches[:4], batches[4:6] + batches[:2], batches[2:6], batches[6:]]
    data.mean_of_means_run(reference, opt, windows)
    assert _off(model.state_dict(), reference.state_dict()) < 1e-6


def test_counts_that_cannot_be_attributed_are_refused():
    """Two ``aiak.count_items`` before one backward (which is that backward's?), and ``aiak.count_items`` beside
    ``count_items=fn`` (the batch would be counted twice): one clear error each."""
    batches = data.rank_batches(0, 1, n=4)

    def twice(model, opt, loader):
        for batch in loader:
            aiak.count_items(opt, data.count_tokens(batch))
            aiak.count_items(opt, data.count_tokens(batch))
            data.token_loss(model, batch).backward()
            opt.step()

    with pytest.raises(RuntimeError, match="called twice before one backward"):
        _token_run(batches, {"grad_accumulation": 2}, twice, count=True)

    def beside(model, opt, loader):
        for batch in loader:
            aiak.count_items(opt, data.count_tokens(batch))

    with pytest.raises(RuntimeError, match="counts each batch of the loader it returned already"):
        _token_run(batches, {"grad_accumulation": 2}, beside, count=data.count_tokens)


def test_an_epoch_length_that_changes_is_read_at_each_iteration():
    """A loader whose ``len()`` changes between epochs (balanced batches are rebuilt each epoch): 6 batches, then 5,
    accumulation 4. Each epoch's last step closes its window: windows 4, 2, then 4, 1."""
    class Shrinking:
        def __init__(self, batches):
            self.batches, self.epoch = batches, 0

        def __len__(self):
            return 6 if self.epoch == 0 else 5

        def __iter__(self):
            n = len(self)
            self.epoch += 1
            return iter(self.batches[:n])

    def loop(model, opt, loader):
        stepped = []
        for _ in range(2):
            for batch in loader:
                data.token_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
                stepped.append(aiak.stepped(opt))
        return stepped

    _, stepped, _ = _token_run(Shrinking(data.rank_batches(0, 1, n=6)), {"grad_accumulation": 4}, loop)
    assert stepped == [False, False, False, True, False, True] + [False, False, False, True, True]
