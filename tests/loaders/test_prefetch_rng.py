"""Prefetching a loader that draws random numbers in the training process (``num_workers=0`` with random
augmentation, torchvision's ``-j 0``) while the model draws too (dropout): the loading thread and the step once
raced for the process's random number generators, so a seeded run gave other weights each time. Loading that
draws now happens in the step, in plain PyTorch's order: the same weights as plain PyTorch, every time."""
import random
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import aiak
from aiak.loaders import PrefetchLoader

pytestmark = pytest.mark.usefixtures("warnings_said_again")


class Augmented(Dataset):
    """Random flips from torch's RNG and random crops from Python's, as torchvision's and timm's transforms draw."""

    def __init__(self, n=48):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 10, 10, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        top = random.randint(0, 2)
        return x[:, top:top + 8, top:top + 8], self.y[i]


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))


def _run(prefetch: bool):
    torch.manual_seed(2)
    random.seed(2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=0)
    if prefetch:
        model, opt, loader = aiak.optimize(model, opt, loader, strategy={"loader": {"prefetch": 2}})
    for _ in range(2):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_seeded_run_with_in_process_random_loading_equals_plain_pytorch_every_time():
    plain = _run(prefetch=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [_run(prefetch=True) for _ in range(3)]
    for run in runs:
        for p, q in zip(run, plain):
            assert torch.equal(p, q)
    said = [str(w.message) for w in caught if "draws random numbers" in str(w.message)]
    assert len(said) == 1 and "num_workers" in said[0], said  # once, with what to do instead


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("shuffle", [False, True])
def test_loading_without_random_draws_runs_in_the_thread_from_the_second_batch(shuffle, workers):
    """A shuffling sampler draws its seed at the first batch, once per epoch: that is not the dataset drawing,
    so the thread takes over right after the first batch (only that one loads without overlap)."""
    loader = PrefetchLoader(DataLoader(torch.arange(12.0), batch_size=2, shuffle=shuffle, num_workers=workers),
                            "cpu", depth=2)
    for _ in range(2):
        epoch = iter(loader)
        batches = [next(epoch).tolist()]
        assert epoch._thread is not None and epoch._in_step is False
        batches += [b.tolist() for b in epoch]
        assert sorted(v for b in batches for v in b) == list(range(12))


class Draws:
    """Whether the sampler's permutation draws from torch's generator, then nothing while loading."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_a_sampler_drawing_a_permutation_lets_the_thread_take_over_at_the_second_batch():
    """Batch 0 drew more than a seed (a sampler's own permutation): batch 1 is checked in the step, drawing
    nothing, and the thread loads the rest; every batch once, in the sampler's order."""
    torch.manual_seed(3)
    expected = [v for b in DataLoader(torch.arange(12.0), batch_size=2, sampler=Draws(12)) for v in b.tolist()]
    torch.manual_seed(3)
    loader = PrefetchLoader(DataLoader(torch.arange(12.0), batch_size=2, sampler=Draws(12)), "cpu", depth=2)
    epoch = iter(loader)
    batches = [next(epoch).tolist()]
    assert epoch._thread is None and epoch._in_step is None
    batches.append(next(epoch).tolist())
    assert epoch._thread is not None and epoch._in_step is False
    batches += [b.tolist() for b in epoch]
    assert [v for b in batches for v in b] == expected


@pytest.mark.parametrize("shuffle", [False, True])
def test_in_step_loading_yields_every_batch_once(shuffle):
    torch.manual_seed(0)
    loader = PrefetchLoader(DataLoader(Augmented(10), batch_size=3, shuffle=shuffle), "cpu", depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert sum(len(y) for _, y in loader) == 10
        assert sum(len(y) for _, y in loader) == 10
