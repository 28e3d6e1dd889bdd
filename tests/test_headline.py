"""``optimize()`` says what it applied in two lines on rank 0's stderr, whatever logging the script configured
(torchvision's script configures none, and aiak's INFO table was never seen)."""
import logging

import torch
from torch import nn

import aiak


def _optimize():
    model = nn.Linear(4, 2)
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"grad_accumulation": 2})


def test_two_lines_on_stderr_with_logging_unconfigured(capsys):
    logging.getLogger("aiak").setLevel(logging.WARNING)  # a script that configures nothing sees no INFO
    _optimize()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("aiak: applied strategy") and "grad_accumulation=2" in lines[0]
    assert "aiak.last_decision()" in lines[1] and "aiak explain" in lines[1]


def test_nothing_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's rank, no process group initialized yet
    _optimize()
    assert "aiak: applied" not in capsys.readouterr().err
