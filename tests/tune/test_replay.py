"""Borrowed batches are given back: the loop sees every batch of the epoch exactly once, in the loader's order."""
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from aiak.tune.replay import ReplayLoader, borrow


def _loader(seed=0, sampler=None):
    data = TensorDataset(torch.arange(40.).view(20, 2), torch.arange(20))
    if sampler is not None:
        return DataLoader(data, batch_size=3, sampler=sampler(data))
    return DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _labels(batches):
    return [b[1].tolist() for b in batches]


def test_first_epoch_is_the_epoch_a_fresh_loop_would_see_and_later_epochs_are_the_loaders():
    torch.manual_seed(1)
    reference = _loader()
    expected = [_labels(reference), _labels(reference)]
    loader = _loader()
    batches, replay = borrow(loader, 3)
    assert isinstance(replay, ReplayLoader) and len(batches) == 3 and replay.pending == 3
    first = _labels(replay)
    assert first == expected[0]                       # same batches, same order, none twice
    assert sorted(sum(first, [])) == list(range(20))  # every sample once (7 batches, the last one short)
    assert _labels(replay) == expected[1]             # the second epoch is the loader's own
    assert len(replay) == len(loader) and replay.dataset is loader.dataset


def test_global_rng_order_matches_a_fresh_loop():
    torch.manual_seed(7)
    data = TensorDataset(torch.arange(10.), torch.arange(10))
    expected = _labels(DataLoader(data, batch_size=2, shuffle=True))
    after_reference = torch.get_rng_state()
    torch.manual_seed(7)
    batches, replay = borrow(DataLoader(data, batch_size=2, shuffle=True), 2)
    assert torch.equal(torch.get_rng_state(), after_reference)  # the sampler drew its order at the first batch
    assert _labels(replay) == expected


def test_epoch_changed_before_the_loop_drops_the_borrowed_batches():
    sampler = lambda d: DistributedSampler(d, num_replicas=1, rank=0, shuffle=True, seed=3)  # noqa: E731
    reference = _loader(sampler=sampler)
    reference.sampler.set_epoch(5)
    expected = _labels(reference)
    loader = _loader(sampler=sampler)
    _, replay = borrow(loader, 2)
    replay.sampler.set_epoch(5)   # a resumed run sets its epoch before iterating
    assert _labels(replay) == expected


def test_short_loader_gives_what_it_has():
    loader = DataLoader(TensorDataset(torch.arange(4.)), batch_size=2)
    batches, replay = borrow(loader, 5)
    assert len(batches) == 2
    assert [b[0].tolist() for b in replay] == [[0., 1.], [2., 3.]]
