"""loader.balanced: every epoch is shuffled as the user's own sampler would have shuffled it.

Through ``wrap_loader`` (what ``aiak.optimize`` applies), with and without the prefetcher, for the three samplers
a ``DataLoader`` can have: ``DistributedSampler`` (order from its seed and epoch; ``set_epoch`` through every
handle), ``RandomSampler`` (a new order each epoch, drawn from its generator or torch's global RNG exactly as a
plain ``DataLoader`` draws it) and ``SequentialSampler`` (the same order every epoch).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from aiak.loaders import BalancedBatchSampler, PadCollate, PrefetchLoader, balance_loader, wrap_loader
from aiak.strategy.schema import LoaderConfig

pytestmark = pytest.mark.timeout(120)

EPOCHS = 3


class Tokens(Dataset):
    """Sample i is ``(tokens, i)`` with a log-normal number of tokens; ``lengths`` declares them."""

    def __init__(self, n: int = 96):
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.exp(torch.randn(n, generator=g) * 0.8 + 3).long().clamp(1, 200).tolist()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((self.lengths[i],), i), i


def wrap(loader, prefetch: int):
    wrapped = wrap_loader(loader, LoaderConfig(prefetch=prefetch, balanced=True), torch.device("cpu"))
    assert isinstance(wrapped, PrefetchLoader if prefetch else DataLoader)
    assert isinstance(wrapped.batch_sampler, BalancedBatchSampler)
    return wrapped


def batches(loader):
    return [idx.tolist() for _, idx in loader]


def assert_length_sorted_groups(epoch, lengths):
    """Batches are consecutive groups of the length-sorted order (balanced), not random mixes of lengths."""
    spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in epoch)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(spans, spans[1:])), spans


SET_EPOCH_HANDLES = {
    "user sampler": lambda user_sampler, loader, epoch: user_sampler.set_epoch(epoch),
    "loader": lambda user_sampler, loader, epoch: loader.set_epoch(epoch),
    "loader.sampler": lambda user_sampler, loader, epoch: loader.sampler.set_epoch(epoch),
    "loader.batch_sampler": lambda user_sampler, loader, epoch: loader.batch_sampler.set_epoch(epoch),
}


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("handle", list(SET_EPOCH_HANDLES))
def test_distributed_sampler_order_follows_its_seed_and_set_epoch_through_every_handle(handle, prefetch):
    dataset, world, seed = Tokens(), 2, 5
    set_epoch = SET_EPOCH_HANDLES[handle]
    per_rank = []
    for rank in range(world):
        user_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        wrapped = wrap(DataLoader(dataset, batch_size=4, sampler=user_sampler, collate_fn=PadCollate()), prefetch)
        reference = BalancedBatchSampler(dataset.lengths, 4, num_replicas=world, rank=rank, seed=seed)
        epochs = []
        for epoch in range(EPOCHS):
            set_epoch(user_sampler, wrapped, epoch)
            assert user_sampler.epoch == wrapped.batch_sampler.epoch == epoch  # one epoch, whatever the handle
            order = batches(wrapped)
            assert batches(wrapped) == order  # no set_epoch, no new order (as DistributedSampler)
            assert order == [step[rank] for step in reference.plan(epoch)]  # a function of (seed, epoch)
            epochs.append(order)
        assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
        set_epoch(user_sampler, wrapped, 1)
        assert batches(wrapped) == epochs[1]  # the same epoch again gives the same order
        assert wrapped.sampler is user_sampler  # the user's sampler is still the loader's sampler
        per_rank.append(epochs)
    for epoch in range(EPOCHS):
        assert len(per_rank[0][epoch]) == len(per_rank[1][epoch])  # the ranks agree on the number of steps
        seen = {i for rank_epochs in per_rank for batch in rank_epochs[epoch] for i in batch}
        assert seen == set(range(len(dataset)))  # and split the data between them


@pytest.mark.parametrize("prefetch", [0, 2])
def test_distributed_sampler_seed_changes_the_order(prefetch):
    dataset = Tokens()
    orders = []
    for seed in (5, 6):
        user_sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed)
        orders.append(batches(wrap(DataLoader(dataset, batch_size=4, sampler=user_sampler, collate_fn=PadCollate()),
                                        prefetch)))
    assert orders[0] != orders[1]


def plain_epochs(make_loader):
    loader = make_loader()
    return [[int(i) for _, idx in loader for i in idx] for _ in range(EPOCHS)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_random_sampler_reshuffles_every_epoch_from_the_global_rng_as_a_dataloader_would(prefetch):
    dataset = Tokens()

    def make():
        return DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=PadCollate())

    torch.manual_seed(123)
    wrapped = wrap(make(), prefetch)
    epochs = [batches(wrapped) for _ in range(EPOCHS)]
    rng_after_balanced = torch.get_rng_state()
    torch.manual_seed(123)
    plain_epochs(make)
    # The balanced loader drew exactly what the plain loader draws from the global RNG, no more, no less:
    # a later torch.randn (dropout, augmentation) sees the same state as without aiak.
    assert torch.equal(rng_after_balanced, torch.get_rng_state())
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # a new order every epoch, no call needed
    for epoch in epochs:
        assert sorted(i for b in epoch for i in b) == list(range(len(dataset)))
        assert_length_sorted_groups(epoch, dataset.lengths)
    torch.manual_seed(123)
    assert [batches(wrapped) for _ in range(EPOCHS)] == epochs  # torch.manual_seed makes runs reproducible
    torch.manual_seed(124)
    assert batches(wrap(make(), prefetch)) != epochs[0]  # the order comes from the draw


@pytest.mark.parametrize("prefetch", [0, 2])
def test_random_sampler_draws_from_the_loader_generator_when_given(prefetch):
    dataset = Tokens()

    def make(seed):
        return DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=PadCollate(),
                          generator=torch.Generator().manual_seed(seed))

    global_rng = torch.get_rng_state()
    balanced = make(7)
    wrapped = wrap(balanced, prefetch)
    epochs = [batches(wrapped) for _ in range(EPOCHS)]
    assert torch.equal(torch.get_rng_state(), global_rng)  # the global RNG is not touched
    plain = make(7)
    plain_epochs(lambda: plain)
    assert torch.equal(balanced.generator.get_state(), plain.generator.get_state())  # consumed as a plain loader
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    again = wrap(make(7), prefetch)
    assert [batches(again) for _ in range(EPOCHS)] == epochs
    assert batches(wrap(make(8), prefetch)) != epochs[0]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sequential_sampler_same_order_every_epoch(prefetch):
    dataset = Tokens()
    wrapped = wrap(DataLoader(dataset, batch_size=4, collate_fn=PadCollate()), prefetch)
    reference = [step[0] for step in BalancedBatchSampler(dataset.lengths, 4, num_replicas=1, rank=0,
                                                          shuffle=False).plan()]
    first = batches(wrapped)
    wrapped.set_epoch(1)  # accepted, changes nothing (a SequentialSampler has no epochs)
    assert first == batches(wrapped) == batches(wrapped) == reference
    assert_length_sorted_groups(first, dataset.lengths)
    torch.manual_seed(0)
    for _ in range(EPOCHS):
        batches(wrapped)
    rng_after_balanced = torch.get_rng_state()
    torch.manual_seed(0)
    plain_epochs(lambda: DataLoader(dataset, batch_size=4, collate_fn=PadCollate()))
    assert torch.equal(rng_after_balanced, torch.get_rng_state())


@pytest.mark.parametrize("budget", [{"batch_size": 4}, {"max_tokens": 256}, {"batch_size": 4, "max_tokens": 300}])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_agree_on_the_step_count_whatever_order_they_draw(budget, drop_last):
    """Ranks whose RNGs differ draw different orders; a different step count would hang DDP."""
    lengths = Tokens(203).lengths
    dataset = list(range(len(lengths)))
    counts = set()
    for rank in range(3):
        sampler = BalancedBatchSampler(lengths, budget.get("batch_size"), max_tokens=budget.get("max_tokens"),
                                       num_replicas=3, rank=rank, drop_last=drop_last,
                                       follow=RandomSampler(dataset, generator=torch.Generator().manual_seed(rank)))
        counts.update(len(list(sampler)) for _ in range(EPOCHS))
        counts.add(len(sampler))
    for rank in range(3):  # DistributedSampler ranks at different epochs
        sampler = BalancedBatchSampler(lengths, budget.get("batch_size"), max_tokens=budget.get("max_tokens"),
                                       drop_last=drop_last,
                                       follow=DistributedSampler(dataset, num_replicas=3, rank=rank))
        sampler.set_epoch(rank)
        counts.update((len(list(sampler)), len(sampler)))
    assert len(counts) == 1, counts


def test_random_sampler_on_several_ranks_shares_one_order_whatever_the_rngs_hold():
    """Ranks seeded differently (torch 2.14 seeds every process at random) must still split the data."""
    lengths = Tokens(203).lengths
    dataset = list(range(len(lengths)))
    samplers = [BalancedBatchSampler(lengths, 4, num_replicas=3, rank=rank,
                                     follow=RandomSampler(dataset, generator=torch.Generator().manual_seed(rank)))
                for rank in range(3)]
    epochs = []
    for _ in range(EPOCHS):
        per_rank = [list(s) for s in samplers]
        seen = [i for batches in per_rank for batch in batches for i in batch]
        assert set(seen) == set(dataset) and len(seen) - len(dataset) < 4 * 3  # a partition (last step padded)
        epochs.append(per_rank[0])
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # reshuffled every epoch without set_epoch


def test_an_already_balanced_loader_is_kept_and_follow_is_validated():
    dataset = Tokens()
    wrapped = wrap(DataLoader(dataset, batch_size=4), 0)
    assert balance_loader(wrapped) is wrapped
    with pytest.raises(ValueError, match="give shuffle/seed or follow, not both"):
        BalancedBatchSampler(dataset.lengths, 4, seed=1, follow=RandomSampler(dataset))
    with pytest.raises(ValueError, match="replacement or num_samples=10 of 96"):
        BalancedBatchSampler(dataset.lengths, 4, follow=RandomSampler(dataset, num_samples=10))
    with pytest.raises(TypeError, match="follow must be a DistributedSampler, RandomSampler or SequentialSampler"):
        BalancedBatchSampler(dataset.lengths, 4, follow=[0, 1])
    with pytest.raises(RuntimeError, match="no epoch has started"):
        BalancedBatchSampler(dataset.lengths, 4, follow=RandomSampler(dataset)).plan()
