"""The trials are invisible to the run that follows, also when the script touches the random streams or the
sampler's epoch between ``optimize()`` and its loop: the weights equal, bit for bit (CPU), those of the same
script with the winner applied from step 0 and no trial at all.

Each script draws from the global RNG in three places: the shuffling sampler, the dataset's random
augmentation (``num_workers=0``: in this process, between the model's steps) and the model's dropout.
"""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import aiak
from aiak.cli.demo import synthetic_dataset
from tests.tune.test_trials import DropoutNet, state

TUNED = {"extends": "default", "channels_last": True, "precision": {"level": "O1", "dtype": "bf16"},
         "tune": {"candidates": 3, "steps": 3, "guard": False}}   # the candidates timed on copies; the run is one's
TIMED_IN_RUN = dict(TUNED, tune={"candidates": 3, "steps": 3})      # the run's first steps time them
PREFETCHED = dict(TUNED, loader={"prefetch": 2})   # loading that draws in this process stays in the step


class Augmented(Dataset):
    """The synthetic images, flipped at random and with random noise: draws from the global RNG per sample."""

    def __init__(self, n=96):
        self.data = synthetic_dataset(n, image_size=16, seed=0)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.1 * torch.randn_like(x), y


def _loader(sampler):
    data = Augmented()
    if sampler == "distributed":
        return DataLoader(data, batch_size=16, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=5))
    return DataLoader(data, batch_size=16, shuffle=True)


def _script(strategy, sampler, before_loop):
    """A training script: build, ``aiak.optimize``, then ``before_loop`` (a reseed, a resumed epoch), then
    two epochs. Returns the weights, the labels seen and the RNG state at the end."""
    torch.manual_seed(1)
    model = DropoutNet(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = aiak.optimize(model, optimizer, _loader(sampler), strategy=strategy)
    decision = aiak.last_decision().to_dict()
    before_loop(loader)
    seen = []
    for _ in range(2):
        for x, y in loader:
            seen.append(y.tolist())
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return decision, state(model), seen, torch.get_rng_state()


def _reseed(loader):
    torch.manual_seed(0)


def _resume_at_epoch_3(loader):
    loader.sampler.set_epoch(3)


def _draw_something(loader):
    torch.randn(7)          # e.g. building a random projection after optimize()


def _nothing(loader):
    pass


@pytest.mark.parametrize("sampler,before_loop,strategy", [
    ("shuffle", _reseed, TUNED), ("distributed", _resume_at_epoch_3, TUNED), ("shuffle", _draw_something, TUNED),
    ("shuffle", _nothing, TUNED), ("distributed", _nothing, TUNED), ("shuffle", _reseed, PREFETCHED)])
def test_run_after_trials_is_the_winners_run_from_step_0(sampler, before_loop, strategy):
    decision, weights, seen, rng = _script(strategy, sampler, before_loop)
    assert not decision["cache_hit"] and len(decision["trials"]) >= 2 and not decision["tuning"]  # trials ran

    winner = copy.deepcopy(decision["strategy"])
    winner["tune"] = {"enabled": False}
    _, expected_weights, expected_seen, expected_rng = _script(winner, sampler, before_loop)

    assert seen == expected_seen                              # every batch once, in the order the loop would draw
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), "weights differ from the winner's run"
    assert torch.equal(rng, expected_rng)


@pytest.mark.parametrize("sampler,before_loop", [("shuffle", _reseed), ("distributed", _resume_at_epoch_3),
                                                 ("shuffle", _nothing)])
def test_trials_timed_in_the_run_leave_the_batches_and_the_streams_alone(sampler, before_loop):
    """Timed in the run, the first steps compute as the candidates in turn (each passed the gate), so the weights
    are not the pick's run's; but the loop still sees every batch once in the loader's own order, and the random
    streams end where the pick's run without any trial leaves them (dropout and augmentation draw alike)."""
    decision, _, seen, rng = _script(TIMED_IN_RUN, sampler, before_loop)
    assert any("timed in the run" in t["why"] for t in decision["trials"]), decision["trials"]
    pick = copy.deepcopy(decision["strategy"])
    pick["tune"] = {"enabled": False}
    _, _, expected_seen, expected_rng = _script(pick, sampler, before_loop)
    assert seen == expected_seen
    assert torch.equal(rng, expected_rng)
