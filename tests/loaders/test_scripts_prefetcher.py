"""A PrefetchLoader the script built itself (with its own normalization) comes back from optimize() as it was
configured. ``wrap_loader`` once unwrapped it and re-wrapped the loader inside with the strategy's settings:
batches came back as raw uint8 (mean ~120 instead of ~0), and with ``"default"`` the prefetcher vanished."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import aiak
from aiak.loaders import PrefetchLoader

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _images():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (16,), generator=g)), batch_size=4)


@pytest.mark.parametrize("strategy", ["default", {"loader": {"prefetch": 3}}, {"loader": {"prefetch": 1}, "tune": False}],
                         ids=["default", "prefetch3", "prefetch1"])
def test_the_scripts_prefetcher_keeps_its_normalization(strategy):
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64, 4))
    users = PrefetchLoader(_images(), "cpu", depth=2, mean=MEAN, std=STD)
    _, _, loader = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), users, strategy=strategy)
    assert loader is users and loader.depth == 2
    x, _ = next(iter(loader))
    assert x.dtype == torch.float32 and abs(float(x.mean())) < 0.5  # normalized, not raw uint8 (~127)


def test_trials_see_the_prefetchers_batches_and_the_run_keeps_it():
    """With tune on, the trials borrow the first batches: they used to unwrap the script's prefetcher, so every
    candidate got raw uint8 images (and failed), and the run got batches without its normalization."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 36, 4))
    users = PrefetchLoader(_images(), "cpu", depth=2, mean=MEAN, std=STD)
    _, _, loader = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), users,
                                 strategy={"tune": {"enabled": True, "steps": 3}})
    decision = aiak.last_decision().to_dict()
    plain = next(t for t in decision["trials"] if t["label"] == "plain")
    assert plain["accepted"] and plain["step_ms"], decision["tuning"]
    assert isinstance(loader, PrefetchLoader) and loader.depth == 2
    batches = [x for x, _ in loader]
    assert len(batches) == 4 and all(x.dtype == torch.float32 and abs(float(x.mean())) < 0.5 for x in batches)
    assert torch.equal(batches[0], users.prepare(next(iter(_images())))[0])  # the borrowed batch, put back
