"""A derived setting is a row of the decision record with source ``derived`` and its reason, in ``explain`` and
in ``last_decision()`` alike, where DDP's hook applies it; the trials (one process) and one process derive
nothing."""
import copy

import pytest
import torch
from torch import nn

import aiak
from tests.ranks import spawn_ranks

O2_BF16 = {"precision": {"level": "O2", "dtype": "bf16"}, "tune": False}
REASON = "precision O2 on 2 ranks with comm.algorithm allreduce: gradients travel in bf16, as apex's O2 did"


def _o2_on_ranks(rank, world):
    from aiak.api import explain
    from aiak.apply import apply_strategy
    from aiak.strategy.profiles import load_strategy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    explained = explain(model, optimizer, strategy=O2_BF16)
    trial = apply_strategy(load_strategy(O2_BF16), copy.deepcopy(model), None, None, None, None, distributed=False)
    ddp, optimizer, _ = aiak.optimize(model, optimizer, strategy=O2_BF16)
    decision = aiak.last_decision()
    return {"explained": explained.knobs["comm.compression"], "recorded": decision.knobs["comm.compression"],
            "log": decision.render(), "chosen": decision.strategy["comm"]["compression"],
            "hook": ddp.aiak_comm_state.compression, "trial": trial.derived}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_o2_on_two_ranks_records_its_half_gradients_as_derived():
    for result in spawn_ranks(_o2_on_ranks, world=2, timeout=150):
        row = {"value": "bf16", "source": "derived", "reason": REASON}
        assert result["explained"] == result["recorded"] == row
        assert "from derived: " + REASON in result["log"]
        assert result["hook"] == "bf16"          # what DDP's hook sends is what the record says
        assert result["chosen"] == "none"        # the strategy as chosen, which derives it again
        assert result["trial"] == []             # the trials apply in one process


def test_one_process_derives_nothing():
    model = nn.Linear(4, 2)
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=O2_BF16)
    row = aiak.last_decision().knobs["comm.compression"]
    assert row["source"] == "default" and row["value"] == "none"
