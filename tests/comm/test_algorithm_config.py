"""``comm.algorithm`` and its sections in a strategy: validation (every mistake at once, with did-you-mean and the
reason), what ``aiak explain`` says each trades, and that the auto-selector never varies them."""
import pytest
import torch

from aiak.api import explain
from aiak.comm.algorithms import REGISTRY
from aiak.strategy import knobs
from aiak.strategy.schema import Strategy, StrategyError


def _problems(comm):
    with pytest.raises(StrategyError) as e:
        Strategy.from_dict({"comm": comm})
    return str(e.value)


def test_every_mistake_of_the_algorithm_sections_is_reported_at_once():
    text = _problems({"algorithm": "local_sdg", "local_sgd": {"perod": 4}, "decentralized": {"peers": "ring"},
                      "powersgd": {"warmup_steps": 1, "rank": 0}})
    assert "comm.algorithm must be one of ['allreduce', 'local_sgd', 'decentralized', 'powersgd'], got " \
           "'local_sdg' (did you mean 'local_sgd'?)" in text
    assert "comm.local_sgd.perod: unknown key (did you mean 'period'?)" in text
    assert "comm.decentralized.peers must be one of ['shift_one', 'all'], got 'ring'" in text
    assert "comm.powersgd.warmup_steps must be >= 2 (DDP rebuilds its buckets" in text
    assert "comm.powersgd.rank must be >= 1, got 0" in text
    assert "comm.local_sgd.period must be >= 1, got 0" in _problems({"local_sgd": {"period": 0}})
    assert "comm.powersgd.bucket_mb must be 'auto' or a number of MB > 0, got 0" in \
        _problems({"powersgd": {"bucket_mb": 0}})
    assert "comm.powersgd.bucket_mb must be one of ['auto', 'a number of MB > 0'], got 'whole'" in \
        _problems({"powersgd": {"bucket_mb": "whole"}})


@pytest.mark.parametrize("algorithm, comm, says", [
    ("powersgd", {"autotune": True}, "does not run with comm.autotune true"),
    ("local_sgd", {"cpu_reduce": True}, "does not run with comm.cpu_reduce true"),
    ("decentralized", {"hierarchical": True}, "decentralized exchanges weights between ranks directly"),
    ("decentralized", {"compression": "fp16"}, "decentralized exchanges weights in full precision; set "
                                               "comm.compression to none"),
    ("powersgd", {"compression": "int8"}, "powersgd is a compression of its own"),
    ("local_sgd", {"compression": "int8"}, "int8's error feedback is for gradients; set comm.compression to none, "
                                           "fp16 or bf16"),
])
def test_settings_an_algorithm_cannot_run_with_are_refused_with_what_to_change(algorithm, comm, says):
    assert says in _problems({"algorithm": algorithm, **comm})


@pytest.mark.parametrize("comm", [{"algorithm": "local_sgd", "hierarchical": True, "compression": "fp16"},
                                  {"algorithm": "local_sgd", "compression": "bf16", "connections": 4},
                                  {"algorithm": "decentralized", "decentralized": {"peers": "all"}},
                                  {"algorithm": "powersgd", "powersgd": {"rank": 2, "warmup_steps": 2}},
                                  {"algorithm": "powersgd", "hierarchical": True}])
def test_what_composes_is_accepted(comm):
    assert Strategy.from_dict({"comm": comm}).comm.algorithm == comm["algorithm"]


@pytest.mark.parametrize("algorithm", [a for a in REGISTRY if a != "allreduce"])
def test_explain_says_what_each_algorithm_trades(algorithm):
    model = torch.nn.Linear(3, 3)
    record = explain(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy={"comm": {"algorithm": algorithm}})
    assert record.knobs["comm.algorithm"]["reason"].endswith("; trades: " + REGISTRY[algorithm].trades)
    assert "trades" not in explain(model, strategy={}).knobs["comm.algorithm"]["reason"]


def test_the_algorithms_change_the_training_so_auto_never_varies_them():
    for path in ("comm.algorithm", "comm.local_sgd", "comm.decentralized", "comm.powersgd"):
        assert path in knobs.training_keys()
