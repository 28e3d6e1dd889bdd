"""The trials choose how the step computes, never what is trained: the knobs that change the training (gradient
accumulation, the optimizer, the loader's sampling and normalization) are the rules' pick in every candidate,
plain PyTorch included, so whichever candidate wins, the run trains what the strategy asked for."""
import copy
import json

import pytest
import torch

import aiak
from aiak.cli.demo import DemoNet
from aiak.optim import Lars
from aiak.strategy.select import resolve_strategy
from aiak.util.cache import TuneCache
from aiak.strategy.select import leaves
from aiak.tune.candidates import candidate_strategies
from tests.tune.test_trials import setup, state

ACCUMULATED_LARS = {"grad_accumulation": 4, "optimizer": {"name": "lars", "lr": 0.1, "momentum": 0.9}}
FP16_LARS = {"extends": "default", "precision": {"level": "O2", "dtype": "fp16"}, **ACCUMULATED_LARS,
             "tune": {"candidates": 4, "steps": 3}}
# on a model that refuses channels_last inputs, plain is the one candidate that runs: it must win
CHANNELS_LAST_LARS = {"extends": "default", "channels_last": True, "loader": {"prefetch": 2}, **ACCUMULATED_LARS,
                      "tune": {"candidates": 4, "steps": 3}}


class RefusesChannelsLast(DemoNet):
    def forward(self, x):
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
            raise RuntimeError("this model refuses channels_last inputs")
        return super().forward(x)


# what the schema has that changes what is trained: the effective batch and how often the optimizer steps, the
# update rule and its hyper-parameters, the batches' composition and normalization, how the ranks synchronise
TRAINING_PATHS = ("grad_accumulation", "optimizer", "loader.balanced", "loader.max_tokens", "loader.mean", "loader.std",
                  "comm.algorithm", "comm.local_sgd", "comm.decentralized", "comm.powersgd")


def _training_knobs(strategy):
    return {k: v for k, v in leaves(strategy.to_dict())
            if any(k == key or k.startswith(key + ".") for key in TRAINING_PATHS)}


def test_the_candidates_module_names_the_same_training_knobs():
    from aiak.tune.candidates import TRAINING_KEYS

    assert set(TRAINING_KEYS) == set(TRAINING_PATHS)


def test_every_candidate_keeps_the_picks_training_knobs():
    model, optimizer, loader = setup()
    selection = resolve_strategy(FP16_LARS, model, optimizer, loader)
    pick = selection.strategy
    expected = _training_knobs(pick)
    assert expected["grad_accumulation"] == 4 and expected["optimizer.name"] == "lars"
    candidates = candidate_strategies(pick, selection.probes, limit=8, max_seconds=None)
    labels = [c.label for c in candidates]
    assert "plain" in labels and len(candidates) >= 2, labels
    for c in candidates:
        assert _training_knobs(c.strategy) == expected, c.label
        assert not set(_training_knobs(c.strategy)) & set(c.changes), c.changes
    plain = next(c for c in candidates if c.label == "plain")
    assert plain.strategy.precision.level == "O0"        # plain PyTorch compute ...
    assert plain.strategy.grad_accumulation == 4           # ... training what the pick trains


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train(model, optimizer, loader, calls):
    """``calls`` iterations of the plain loop; for each, whether its ``step()`` changed the weights."""
    changed, previous = [], _params(model)
    batches = iter(loader)
    for _ in range(calls):
        x, y = next(batches)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        now = _params(model)
        changed.append(any(not torch.equal(a, b) for a, b in zip(previous, now)))
        previous = now
    return changed


def _setup(refuses_channels_last):
    model, optimizer, loader = setup(n=256)
    if refuses_channels_last:
        torch.manual_seed(0)
        model = RefusesChannelsLast(width=8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer, loader


@pytest.mark.filterwarnings("ignore::UserWarning")     # fp16 on this CPU is emulated: aiak says so
@pytest.mark.parametrize("strategy,refuses_channels_last", [(FP16_LARS, False), (CHANNELS_LAST_LARS, True)])
def test_whatever_wins_the_run_keeps_accumulation_and_lars(strategy, refuses_channels_last):
    model, optimizer, loader = _setup(refuses_channels_last)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
    decision = aiak.last_decision().to_dict()
    assert len(decision["trials"]) >= 2 and not decision["tuning"]             # the trials measured
    if refuses_channels_last:
        assert decision["strategy"]["name"] == "plain" and decision["strategy"]["channels_last"] is False
    assert decision["strategy"]["grad_accumulation"] == 4
    assert decision["strategy"]["optimizer"]["name"] == "lars"
    assert decision["knobs"]["grad_accumulation"]["source"] == "user"
    assert decision["knobs"]["optimizer.name"]["source"] == "user"
    assert isinstance(optimizer, Lars)

    # the optimizer really steps every 4th step() call (not on the others), with LARS's update
    assert _train(model, optimizer, loader, 8) == [False, False, False, True] * 2

    # and the run equals the winner applied with the trials off
    winner = copy.deepcopy(decision["strategy"])
    winner["tune"] = {"enabled": False}
    ref_model, ref_optimizer, ref_loader = _setup(refuses_channels_last)
    ref_model, ref_optimizer, ref_loader = aiak.optimize(ref_model, ref_optimizer, ref_loader, strategy=winner)
    assert isinstance(ref_optimizer, Lars)
    _train(ref_model, ref_optimizer, ref_loader, 8)
    a, b = state(model), state(ref_model)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_cached_decision_gets_the_picks_training_knobs_too():
    model, optimizer, loader = setup(n=128)
    aiak.optimize(model, optimizer, loader, strategy=FP16_LARS)                    # trials run, the cache is filled
    cache = TuneCache()
    data = json.loads(cache.path.read_text())
    (key, entry), = data.items()
    entry["strategy"].update(grad_accumulation=1, optimizer={"name": "keep"})     # an entry that dropped them
    entry["load"] = None     # so that another test process's load now cannot have it measured again
    cache.put_entry(key, entry)
    model, optimizer, loader = setup(n=128)
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=FP16_LARS)
    decision = aiak.last_decision().to_dict()
    assert decision["cache_hit"]
    assert decision["strategy"]["grad_accumulation"] == 4 and decision["strategy"]["optimizer"]["name"] == "lars"
    assert isinstance(optimizer, Lars)
