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
    assert lines[0].startswith("aiak: applied the strategy given") and "grad_accumulation=2" in lines[0]
    assert "custom" not in lines[0]   # the placeholder name of a strategy given without one is not shown
    assert "aiak.last_decision()" in lines[1] and "aiak explain" in lines[1]


def test_nothing_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's rank, no process group initialized yet
    _optimize()
    assert "aiak: applied" not in capsys.readouterr().err


def test_what_the_trials_chose_is_said_in_words():
    """The trials' candidates are named by what they are: the rules' pick (the first row), plain compute (which
    keeps the pick's loader knobs, so 'plain' alone misled), the pick's numerics-neutral knobs, or the pick with
    one knob changed; never "trials chose 'auto'" for a pick named auto."""
    from aiak.tune.decision import candidate_words

    rows = [{"label": "auto"}, {"label": "neutral"}, {"label": "plain"}, {"label": "O2"}]
    assert candidate_words("auto", rows) == "kept the rules' pick"
    assert candidate_words("plain", rows) == "chose plain compute"
    assert candidate_words("neutral", rows) == "chose the pick's numerics-neutral knobs"
    assert candidate_words("O2", rows) == "chose the pick with O2"


def test_a_second_call_that_differs_names_the_strategies_it_was_given():
    model = nn.Linear(4, 2)
    aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"channels_last": True})
    try:
        aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"channels_last": False})
    except ValueError as e:
        assert "optimized before with the strategy given; the strategy given for this call differs" in str(e)
        assert "custom" not in str(e)
    else:
        raise AssertionError("a second call with other model knobs was accepted")


def test_the_trials_table_names_plain_compute_and_what_every_candidate_shares():
    """The trials' 'plain' candidate keeps the pick's loader knobs (prefetching): its row says plain compute, and
    one line says what every candidate shares."""
    from aiak.tune.decision import Decision

    row = {"step_ms": 10.0, "step_ms_spread": [9.0, 11.0], "speedup": 1.0, "peak_mem_mb": None, "grad_cosine": None,
           "accepted": True, "why": "plain PyTorch: the fp32 reference"}
    decision = Decision(strategy={"name": "auto"}, knobs={},
                        trials=[dict(row, label="auto", why="x; chosen"), dict(row, label="plain")])
    table = decision.render().splitlines()
    assert any(line.split()[:1] == ["plain-compute"] for line in table)   # one word: scripts split the columns
    assert not any(line.split()[:1] == ["plain"] for line in table)
    assert any("runs with the pick's loader and training knobs" in line for line in table)
