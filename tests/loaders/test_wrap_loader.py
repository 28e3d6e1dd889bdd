"""wrap_loader: what aiak.optimize applies for a strategy's ``loader:`` section."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from aiak.loaders import BalancedBatchSampler, PadCollate, PrefetchLoader, balance_loader, wrap_loader
from aiak.strategy.schema import LoaderConfig
from tests.ranks import spawn_ranks

pytestmark = pytest.mark.timeout(120)


class Sentences(Dataset):
    """Variable-length token sequences; ``lengths`` tells the sampler without reading samples."""

    def __init__(self, n: int = 96, declare_lengths: bool = True):
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(1, 100, (int(n_),), generator=g)
                     for n_ in torch.exp(torch.randn(n, generator=g) + 3).long().clamp(1, 200)]
        if declare_lengths:
            self.lengths = [len(t) for t in self.data]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i], i


def indices_of(loader):
    return [i for _, idx in loader for i in idx.tolist()]


def test_nothing_asked_returns_the_same_loader():
    loader = DataLoader(torch.arange(10.0), batch_size=2)
    assert wrap_loader(loader, LoaderConfig(), torch.device("cpu")) is loader
    assert wrap_loader(None, LoaderConfig(prefetch=2), torch.device("cpu")) is None


def test_prefetch_wraps_and_yields_the_same_batches():
    loader = DataLoader(torch.arange(10.0), batch_size=3)
    wrapped = wrap_loader(loader, LoaderConfig(prefetch=3), torch.device("cpu"), channels_last=True)
    assert isinstance(wrapped, PrefetchLoader) and wrapped.depth == 3 and wrapped.loader is loader
    assert [b.tolist() for b in wrapped] == [b.tolist() for b in loader]
    again = wrap_loader(wrapped, LoaderConfig(prefetch=2), torch.device("cpu"))
    assert isinstance(again, PrefetchLoader) and again.loader is loader  # never stacked


def test_pin_memory_without_cuda_warns_and_is_skipped(said):
    loader = DataLoader(torch.arange(4.0), batch_size=2)
    with said:
        wrapped = wrap_loader(loader, LoaderConfig(prefetch=1, pin_memory=True), torch.device("cpu"))
    assert "pin_memory: skipped" in said.text
    assert [b.tolist() for b in wrapped] == [[0.0, 1.0], [2.0, 3.0]]


def test_the_decision_does_not_claim_pinning_that_was_skipped(said):
    """On a machine without CUDA, ``loader.pin_memory: true`` is skipped with a warning; the decision record (its
    applied lines and the headline on stderr) says it was skipped too, instead of ``pin_memory=true``."""
    import aiak

    if torch.cuda.is_available():
        pytest.skip("pinning applies on this machine")
    model = torch.nn.Linear(1, 1)
    loader = DataLoader(torch.arange(4.0).unsqueeze(1), batch_size=2)
    with said:
        _, _, wrapped = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                                      strategy={"loader": {"prefetch": 1, "pin_memory": True}})
    assert "pin_memory: skipped" in said.text and isinstance(wrapped, PrefetchLoader)
    decision = aiak.last_decision()
    assert decision.effect("loader.pin_memory").startswith("skipped (no CUDA device")
    headline = decision.headline().splitlines()[0]
    assert "loader.pin_memory=true" not in headline and "skipped: loader.pin_memory (no CUDA device" in headline
    knobs = decision.render(full=True).split("applied:")[0]   # the knob table's row too, not only the applied lines
    assert "skipped (no CUDA device" in next(line for line in knobs.splitlines() if "loader.pin_memory" in line)
    applied = decision.render(full=True).split("applied:")[1]
    assert "pin_memory" in applied and "skipped (no CUDA device" in applied
    assert ["loader", "{prefetch: 1, pin_memory: false, balanced: false}"] in [e[:2] for e in decision.effects]


def test_balanced_rebuilds_the_dataloader_keeping_its_settings():
    dataset = Sentences()
    collate = PadCollate()
    loader = DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate, timeout=30,
                        persistent_workers=True, prefetch_factor=3, drop_last=False)
    wrapped = wrap_loader(loader, LoaderConfig(balanced=True), torch.device("cpu"))
    assert isinstance(wrapped, DataLoader) and wrapped is not loader
    sampler = wrapped.batch_sampler
    assert isinstance(sampler, BalancedBatchSampler) and sampler.batch_size == 4 and sampler.shuffle
    assert (wrapped.num_workers, wrapped.collate_fn, wrapped.timeout, wrapped.persistent_workers,
            wrapped.prefetch_factor) == (2, collate, 30, True, 3)
    assert sorted(indices_of(wrapped)) == list(range(len(dataset)))  # a permutation of the data
    for tokens, idx in wrapped:  # each batch holds samples of similar length
        lengths = [dataset.lengths[i] for i in idx.tolist()]
        assert tokens.shape == (4, -(-max(lengths) // 8) * 8)


def test_balanced_and_prefetch_together():
    dataset = Sentences()
    loader = DataLoader(dataset, batch_size=8, collate_fn=PadCollate())
    wrapped = wrap_loader(loader, LoaderConfig(prefetch=2, balanced=True), torch.device("cpu"))
    assert isinstance(wrapped, PrefetchLoader) and isinstance(wrapped.batch_sampler, BalancedBatchSampler)
    assert sorted(indices_of(wrapped)) == list(range(len(dataset)))
    wrapped.set_epoch(1)  # forwarded to the balanced batch sampler
    assert wrapped.batch_sampler.epoch == 1


def test_lengths_are_measured_from_samples_when_not_declared():
    dataset = Sentences(declare_lengths=False)
    wrapped = balance_loader(DataLoader(dataset, batch_size=4, collate_fn=PadCollate()))
    assert wrapped.batch_sampler.lengths.tolist() == [len(t) for t in dataset.data]


def test_distributed_sampler_gives_rank_world_seed_and_shuffle():
    dataset = Sentences()
    loaders = [DataLoader(dataset, batch_size=4, collate_fn=PadCollate(),
                          sampler=DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=5))
               for r in range(2)]
    wrapped = [balance_loader(loader) for loader in loaders]
    assert [(w.batch_sampler.rank, w.batch_sampler.num_replicas, w.batch_sampler.seed) for w in wrapped] == \
        [(0, 2, 5), (1, 2, 5)]
    ranks = [indices_of(w) for w in wrapped]
    assert len(ranks[0]) == len(ranks[1]) and sorted(ranks[0] + ranks[1]) == list(range(len(dataset)))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.ones(3, 2))


class EveryOther(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self):
        return self.n // 2


@pytest.mark.parametrize("make, reason", [
    (lambda: [torch.ones(2)], "not a torch DataLoader"),
    (lambda: DataLoader(Stream(), batch_size=2), "IterableDataset"),
    (lambda: DataLoader(torch.ones(8, 3), batch_size=2), "same length"),
    (lambda: DataLoader(Sentences(), batch_size=2, sampler=EveryOther(96)), "custom sampler"),
    (lambda: DataLoader(Sentences(), batch_sampler=[[0, 1], [2]]), "custom batch_sampler"),
    (lambda: DataLoader([object()] * 4, batch_size=2), "sample lengths are unknown"),
])
def test_balanced_that_cannot_apply_warns_and_keeps_the_loader(make, reason, said):
    loader = make()
    with said:
        assert wrap_loader(loader, LoaderConfig(balanced=True), torch.device("cpu")) is loader
    assert "loader.balanced: skipped" in said.text and reason in said.text


def test_keys_a_later_schema_may_add_token_budget_and_normalize():
    dataset = Sentences()
    cfg = types.SimpleNamespace(prefetch=1, pin_memory=False, balanced=True, max_tokens=256)
    wrapped = wrap_loader(DataLoader(dataset, batch_size=4, collate_fn=PadCollate(multiple_of=None)), cfg, "cpu")
    assert wrapped.batch_sampler.max_tokens == 256 and wrapped.batch_sampler.batch_size is None
    for tokens, idx in wrapped:
        assert tokens.numel() <= 256
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    cfg = types.SimpleNamespace(prefetch=1, pin_memory=False, balanced=False, mean=(0.5,) * 3, std=(0.25,) * 3)
    (x,) = list(wrap_loader([images], cfg, "cpu"))
    torch.testing.assert_close(x, (images.float() / 255 - 0.5) / 0.25)


# -- under a real process group (gloo): rank and world size come from torch.distributed ----------------------
def _balanced_epochs(rank: int, world: int, kind: str):
    dataset = Sentences(101)
    if kind == "random":  # shuffle=True, the ranks' RNGs seeded differently: they must still split the data
        torch.manual_seed(rank)
        loader = DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=PadCollate())
    else:
        sampler = DistributedSampler(dataset, seed=3)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=PadCollate())
    wrapped = wrap_loader(loader, LoaderConfig(prefetch=2, balanced=True), torch.device("cpu"))
    epochs = []
    for epoch in range(3):
        if kind == "distributed":
            sampler.set_epoch(epoch)
        epochs.append([(idx.tolist(), tokens.numel()) for tokens, idx in wrapped])
    return epochs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["random", "distributed"])
def test_balanced_under_a_process_group_shards_balances_and_reshuffles(kind):
    world = 2
    gathered = spawn_ranks(functools.partial(_balanced_epochs, kind=kind), world, timeout=90)
    lengths = Sentences(101).lengths
    orders = []
    for epoch in range(3):
        steps0, steps1 = gathered[0][epoch], gathered[1][epoch]
        assert len(steps0) == len(steps1) > 0  # same number of steps on both ranks
        seen = [i for steps in (steps0, steps1) for idx, _ in steps for i in idx]
        assert set(seen) == set(range(101)) and len(seen) - 101 < 4 * world  # the ranks split the data
        for (idx0, _), (idx1, _) in zip(steps0, steps1):  # padded tokens per rank within 2x at every step
            t0, t1 = len(idx0) * max(lengths[i] for i in idx0), len(idx1) * max(lengths[i] for i in idx1)
            assert max(t0, t1) / min(t0, t1) < 2.0
        orders.append([idx for idx, _ in steps0])
    assert orders[0] != orders[1] != orders[2] != orders[0]  # every epoch reshuffled
