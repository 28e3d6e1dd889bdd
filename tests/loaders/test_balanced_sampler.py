"""BalancedBatchSampler and PadCollate: a partition of the data, equal batch counts, balanced tokens, padding."""
from __future__ import annotations

import collections
import statistics

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from aiak.loaders import BalancedBatchSampler, PadCollate, tokens_per_rank

pytestmark = pytest.mark.timeout(120)


def skewed_lengths(n: int = 2000, seed: int = 0) -> list:
    """Log-normal lengths (most short, a long tail), like tokenized text."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + 4.0).long().clamp(1, 1024)
    return lengths.tolist()


def rank_batches(lengths, world, **kwargs):
    return [list(BalancedBatchSampler(lengths, num_replicas=world, rank=r, **kwargs)) for r in range(world)]


@pytest.mark.parametrize("world", [1, 3, 4])
def test_every_sample_once_per_epoch_and_equal_batch_counts(world):
    lengths = skewed_lengths(1003)
    per_rank = rank_batches(lengths, world, batch_size=8, seed=1)
    assert len({len(b) for b in per_rank}) == 1, "ranks must get the same number of batches"
    assert all(len(batch) == 8 for batches in per_rank for batch in batches)
    seen = collections.Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(seen) == set(range(1003))  # nothing lost
    extra = sum(seen.values()) - 1003
    assert extra < 8 * world  # only the last step is completed with repeated samples


def test_drop_last_drops_only_the_incomplete_step():
    lengths = skewed_lengths(1003)
    per_rank = rank_batches(lengths, 4, batch_size=8, drop_last=True)
    flat = [i for batches in per_rank for batch in batches for i in batch]
    assert len(flat) == len(set(flat)) == (1003 // 32) * 32


def test_ranks_agree_without_communicating_and_epochs_differ():
    lengths = skewed_lengths(500)
    samplers = [BalancedBatchSampler(lengths, 4, num_replicas=2, rank=r, seed=7) for r in range(2)]
    plan = samplers[0].plan()
    assert plan == samplers[1].plan()
    for rank, sampler in enumerate(samplers):
        assert list(sampler) == [step[rank] for step in plan]
    again = BalancedBatchSampler(lengths, 4, num_replicas=2, rank=0, seed=7)
    assert list(again) == list(samplers[0])  # deterministic from (seed, epoch)
    again.set_epoch(1)
    assert list(again) != list(samplers[0])  # reshuffled next epoch


def test_tokens_per_rank_balanced_far_better_than_distributed_sampler():
    lengths = skewed_lengths(4096)
    world, batch = 4, 16
    plan = BalancedBatchSampler(lengths, batch, num_replicas=world, rank=0, seed=0).plan()
    balanced = [max(t) / min(t) for t in (tokens_per_rank(step, lengths) for step in plan)]

    dataset = list(range(len(lengths)))
    shards = [list(DistributedSampler(dataset, num_replicas=world, rank=r, seed=0)) for r in range(world)]
    baseline = []
    for start in range(0, len(shards[0]) - batch + 1, batch):
        step = [shard[start:start + batch] for shard in shards]
        tokens = tokens_per_rank(step, lengths)
        baseline.append(max(tokens) / min(tokens))
    # Padded tokens per rank: the slowest rank sets the step time.
    balanced.sort()
    assert balanced[int(0.9 * len(balanced))] < 1.05 and balanced[-1] < 1.5, balanced[-5:]
    assert statistics.median(baseline) > 1.5, statistics.median(baseline)
    assert statistics.mean(balanced) < statistics.mean(baseline) / 1.5
    real = [max(t) / min(t) for t in (tokens_per_rank(step, lengths, padded=False) for step in plan)]
    assert statistics.median(real) < 1.01 and max(real) < 1.1  # dealing within a step evens the real tokens too


def test_token_budget_bounds_every_padded_batch():
    lengths = skewed_lengths(1500)
    budget = 4096
    per_rank = rank_batches(lengths, 4, max_tokens=budget, seed=3)
    assert len({len(b) for b in per_rank}) == 1
    for batches in per_rank:
        for batch in batches:
            assert 0 < len(batch) and len(batch) * max(lengths[i] for i in batch) <= budget
    seen = {i for batches in per_rank for batch in batches for i in batch}
    assert seen == set(range(1500))
    with pytest.raises(ValueError, match="max_tokens=100 is smaller than the longest sample"):
        BalancedBatchSampler([5, 300], max_tokens=100, num_replicas=1, rank=0)


def test_batch_size_caps_a_token_budget():
    lengths = [3] * 100
    for batch in BalancedBatchSampler(lengths, 5, max_tokens=1000, num_replicas=2, rank=1):
        assert len(batch) <= 5


@pytest.mark.parametrize("kwargs, match", [
    ({"lengths": [], "batch_size": 2}, "non-empty 1-D"),
    ({"lengths": [1.5, 2.0], "batch_size": 2}, "non-negative integers"),
    ({"lengths": [1, 2]}, "give batch_size"),
    ({"lengths": [1, 2], "batch_size": 0}, "batch_size must be a positive integer"),
    ({"lengths": [1, 2], "batch_size": 2, "rank": 2, "num_replicas": 2}, r"rank must be in \[0, 2\)"),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    kwargs.setdefault("num_replicas", 1)
    with pytest.raises(ValueError, match=match):
        BalancedBatchSampler(**kwargs)


def test_dataloader_with_balanced_sampler_and_pad_collate():
    lengths = skewed_lengths(200)
    dataset = [torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)]
    sampler = BalancedBatchSampler(lengths, 8, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PadCollate(pad_value=-1, multiple_of=8))
    assert len(loader) == len(sampler) == 25
    seen = set()
    for batch, indices in zip(loader, sampler):
        longest = max(lengths[i] for i in indices)
        assert batch.shape == (8, -(-longest // 8) * 8)
        for row, i in zip(batch, indices):
            assert torch.equal(row[:lengths[i]], dataset[i]) and bool((row[lengths[i]:] == -1).all())
            seen.add(i)
    assert seen == set(range(200))


def test_pad_collate_structures_pad_values_and_mask():
    Sample = collections.namedtuple("Sample", "tokens label")
    batch = PadCollate(multiple_of=None)([Sample(torch.tensor([1, 2]), 0), Sample(torch.tensor([3, 4, 5]), 1)])
    assert isinstance(batch, Sample) and batch.tokens.tolist() == [[1, 2, 0], [3, 4, 5]] and batch.label.tolist() == [0, 1]

    collate = PadCollate(pad_value={"labels": -100, "default": 0}, multiple_of=4, return_mask=True)
    out = collate([{"input_ids": torch.tensor([7, 8, 9]), "labels": torch.tensor([1, 2, 3])},
                   {"input_ids": torch.tensor([6]), "labels": torch.tensor([4])}])
    assert out["input_ids"].tolist() == [[7, 8, 9, 0], [6, 0, 0, 0]]
    assert out["labels"].tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]

    features = PadCollate()([torch.ones(3, 2), torch.ones(9, 2)])  # (length, features) samples
    assert features.shape == (2, 16, 2) and features[0, 3:].abs().sum() == 0
    images = PadCollate(fields=(0,))([(torch.ones(5), torch.zeros(3, 2, 2)), (torch.ones(6), torch.zeros(3, 2, 2))])
    assert images[0].shape == (2, 8) and images[1].shape == (2, 3, 2, 2)  # only field 0 is a sequence
    same = PadCollate()([torch.ones(4), torch.ones(4)])
    assert same.shape == (2, 8)  # rounded up even when the batch happens to be equal-length
    with pytest.raises(ValueError, match="not a sequence field"):
        PadCollate(fields=("a",))([{"a": torch.ones(2), "b": torch.ones(2)}, {"a": torch.ones(3), "b": torch.ones(3)}])
    with pytest.raises(ValueError, match="differ beyond dim 0"):
        PadCollate()([torch.ones(3, 2), torch.ones(4, 3)])
    with pytest.raises(ValueError, match="multiple_of must be a positive integer"):
        PadCollate(multiple_of=0)
