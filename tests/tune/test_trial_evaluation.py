"""The trials evaluate each candidate as a script does between epochs (``model.eval()``, a forward under
``torch.inference_mode()``, ``model.train()``), so a candidate that trains but cannot evaluate is rejected before
the run depends on it, with the reason in the decision record."""
import torch
from torch import nn
from torch.utils.data import DataLoader

import aiak
from aiak.cli.demo import DemoNet, synthetic_dataset


class EvaluatesInFp32Only(nn.Module):
    """A head whose evaluation path refuses half-precision features (as an op without a half kernel would); with
    ``fp32_too=False`` it refuses every evaluation, whatever the precision (the script's own limit)."""

    def __init__(self, head, fp32_too=True):
        super().__init__()
        self.head, self.fp32_too = head, fp32_too

    def forward(self, x):
        if torch.is_inference_mode_enabled() and (x.dtype != torch.float32 or not self.fp32_too):
            raise RuntimeError(f"evaluation needs fp32 features, got {x.dtype}")
        return self.head(x)


def test_a_candidate_whose_evaluation_fails_is_rejected_with_the_reason():
    torch.manual_seed(0)
    model = DemoNet(width=8)
    model.head = EvaluatesInFp32Only(model.head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic_dataset(128, image_size=16, seed=0), batch_size=32)
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"},
                "tune": {"candidates": 4, "steps": 3}}
    model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=strategy)
    trials = aiak.last_decision().to_dict()["trials"]
    half = [t for t in trials if t["strategy"].get("precision.level") in ("O1", "O2")]
    assert half, trials  # the pick (O1 bf16) is a candidate on every CPU
    for t in half:
        assert not t["accepted"] and "evaluation" in t["why"] and "needs fp32 features" in t["why"], t
    plain = next(t for t in trials if t["strategy"] == {} or t.get("why", "").startswith("plain"))
    assert plain["accepted"]
    assert aiak.last_decision().to_dict()["strategy"]["precision"]["level"] == "O0"
    model.eval()
    with torch.inference_mode():
        model(next(iter(loader))[0])  # the run evaluates


class RecordsEvaluationBatches(nn.Module):
    """A head that notes the number of samples of each forward under inference mode (in a list of the class: each
    candidate runs a deep copy)."""

    seen = []

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        if torch.is_inference_mode_enabled():
            RecordsEvaluationBatches.seen.append(x.shape[0])
        return self.head(x)


def test_each_candidate_evaluates_on_two_samples_and_only_the_gated_ones_are_compared():
    """The evaluation forward needs two samples, not the batch, and plain PyTorch's is taken only where a candidate's
    fails (to tell the script's own failure from the candidate's); plain PyTorch is the gate's reference and a
    numerics-neutral candidate is not judged, so neither shows a cosine."""
    RecordsEvaluationBatches.seen.clear()
    torch.manual_seed(0)
    model = DemoNet(width=8)
    model.head = RecordsEvaluationBatches(model.head)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic_dataset(128, image_size=16, seed=0), batch_size=32)
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"}, "channels_last": True,
                "tune": {"candidates": 4, "steps": 3, "guard": False}}
    aiak.optimize(model, optimizer, loader, strategy=strategy)
    trials = aiak.last_decision().to_dict()["trials"]
    seen = RecordsEvaluationBatches.seen
    assert len(seen) == len(trials) - 1 and set(seen) == {2}, seen     # every candidate's but plain's
    for t in trials:
        neutral = set(t["strategy"]) <= {"channels_last", "loader.prefetch"}
        assert (t["grad_cosine"] is None) == neutral, t


def test_where_plain_pytorch_cannot_evaluate_either_no_candidate_is_rejected_for_it():
    """Plain PyTorch evaluated (only once a candidate's evaluation failed) and failed too: the script does not
    evaluate so, and the candidates are judged by their training steps alone."""
    torch.manual_seed(0)
    model = DemoNet(width=8)
    model.head = EvaluatesInFp32Only(model.head, fp32_too=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(synthetic_dataset(128, image_size=16, seed=0), batch_size=32)
    strategy = {"extends": "default", "precision": {"level": "O1", "dtype": "bf16"},
                "tune": {"candidates": 4, "steps": 3, "guard": False}}
    aiak.optimize(model, optimizer, loader, strategy=strategy)
    trials = aiak.last_decision().to_dict()["trials"]
    assert len(trials) >= 2 and not any("evaluation" in t["why"] for t in trials), trials
