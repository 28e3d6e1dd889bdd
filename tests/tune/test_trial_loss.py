"""The trial step runs on any loader: cross-entropy only where ``batch[1]`` really is a class index for the
output, another loss valid for any floating output otherwise; and when no candidate could be measured, the
decision record says so and why instead of naming a winner."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import aiak
from aiak.api import explain
from aiak.cli.demo import DemoNet
from aiak.tune.trial_run import trial_loss
from tests.tune.test_trials import TUNED, UNGUARDED


def test_cross_entropy_only_for_class_indices_of_the_outputs_shape():
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, 2, 1, 0])
    assert torch.equal(trial_loss(logits, (None, labels)), nn.functional.cross_entropy(logits, labels))
    ignored = torch.tensor([0, -100, 1, 2])                              # cross-entropy's ignore_index
    assert torch.equal(trial_loss(logits, (None, ignored)), nn.functional.cross_entropy(logits, ignored))
    masks = torch.randn(2, 3, 5, 5), torch.randint(0, 3, (2, 5, 5))      # segmentation: (N, C, H, W) + (N, H, W)
    assert torch.equal(trial_loss(masks[0], (None, masks[1])), nn.functional.cross_entropy(*masks))

    square = logits.square().mean()
    for not_classes in (torch.tensor([0, 2, 3, 1]),                      # an index beyond the 3 classes
                        torch.tensor([0, 2, -1, 1]),                     # a negative one
                        torch.randn(4),                                  # a regression target
                        torch.randint(0, 3, (4, 1)),                     # another shape
                        torch.tensor([True, False, True, True])):        # not an integer tensor
        assert torch.equal(trial_loss(logits, (None, not_classes)), square), not_classes
    mask_of_other_shape = torch.randint(0, 3, (2, 1, 5, 5))
    assert torch.equal(trial_loss(masks[0], (None, mask_of_other_shape)), masks[0].square().mean())


def test_an_output_without_a_floating_tensor_is_a_clear_error():
    with pytest.raises(TypeError, match="no floating-point tensor"):
        trial_loss({"ids": torch.arange(3)}, (None,))


class SegmentationNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 1))

    def forward(self, x):
        return self.body(x)


def _loader(targets):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(len(targets), 3, 16, 16, generator=g), targets), batch_size=8)


LOADERS = {
    "regression": (lambda: DemoNet(num_classes=1, width=8), lambda: torch.randn(32)),
    "sample_index": (lambda: DemoNet(num_classes=10, width=8), lambda: torch.arange(32)),
    "mask_of_other_shape": (SegmentationNet, lambda: torch.randint(0, 4, (32, 1, 16, 16))),
}


@pytest.mark.parametrize("kind", list(LOADERS))
def test_trials_measure_on_loaders_whose_second_item_is_no_class_index(kind):
    make_model, make_targets = LOADERS[kind]
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    aiak.optimize(model, optimizer, _loader(make_targets()), strategy=UNGUARDED)   # timed on copies, not in the run
    d = aiak.last_decision().to_dict()
    assert d["tuning"] == "" and len(d["trials"]) >= 2
    plain = next(t for t in d["trials"] if t["label"] == "plain")
    assert plain["accepted"] and plain["step_ms"] > 0, plain["why"]
    assert all(t["step_ms"] > 0 for t in d["trials"] if t["accepted"])
    assert sum("chosen" in t["why"] for t in d["trials"]) == 1


class NeedsAMask(DemoNet):
    """Takes ``(x, mask)``: the trial step, which feeds ``batch[0]`` alone, cannot run it under any candidate."""

    def forward(self, x, mask):
        return super().forward(x * mask)


def test_when_every_candidate_fails_the_record_says_so_and_claims_no_winner():
    torch.manual_seed(0)
    model = NeedsAMask(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 3, 16, 16)
    loader = DataLoader(TensorDataset(x, torch.ones_like(x), torch.randint(0, 10, (32,))), batch_size=8)
    pick = explain(model, optimizer, loader, strategy=TUNED).strategy
    assert pick["channels_last"] is True and pick["precision"]["level"] == "O1"    # what the rules would apply
    with pytest.warns(UserWarning, match="every candidate failed its trial step.*missing 1 required positional "
                                         "argument.*the training script itself") as said:
        model, optimizer, loader = aiak.optimize(model, optimizer, loader, strategy=TUNED)
    assert sum("every candidate failed" in str(w.message) for w in said) == 1
    decision = aiak.last_decision()
    d = decision.to_dict()
    assert d["trials"] and not any(t["accepted"] for t in d["trials"])
    assert all("TypeError" in t["why"] for t in d["trials"] if t["label"] == "plain")
    assert "every candidate failed" in d["tuning"] and "missing 1 required positional argument" in d["tuning"]
    # nothing the trials could not verify: plain PyTorch compute, not the rules' pick
    assert d["strategy"]["channels_last"] is False and d["strategy"]["precision"]["level"] == "O0"
    assert next(model.parameters()).is_contiguous() and not hasattr(optimizer, "_aiak_steps")
    assert not any(k["source"] == "measured" for k in d["knobs"].values())
    assert "every trial failed" in d["knobs"]["precision.level"]["reason"]
    text = decision.render() + decision.render(full=True)
    assert "fastest" not in text and "chosen" not in text
    assert "every candidate failed" in decision.render()
    x, mask, y = next(iter(loader))                                     # and the user's run goes on
    nn.functional.cross_entropy(model(x, mask), y).backward()
    optimizer.step()
