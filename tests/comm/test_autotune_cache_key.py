"""The comm autotuner's cache: keyed by every input of the decision, and no entry applied that the run forbids.

Before: the key left out ``comm.tune_int8`` (and the bucket sizes tried, the hierarchical switch, ...), and a
cache hit was applied unchecked, so a run with ``tune_int8: false`` ran int8 chosen by an earlier run.
"""
import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from aiak.comm.allreduce.autotune import CommChoice, TuneInputs, cached_choice, read_choice
from aiak.util.cache import TuneCache
from aiak.strategy.schema import CommConfig
from tests.ranks import spawn_ranks

BASE = TuneInputs(world_size=4, local_size=2, device_type="cpu", perf_mode="comm", int8=False, hierarchical="auto",
                  groups=True, bucket_mbs=(25.0, 5.0, 50.0), tune_steps=3, int8_block=2048, compress_intra=False,
                  pipeline_mb=2.0)
OTHER_VALUE = {"world_size": 8, "local_size": 4, "device_type": "cuda", "perf_mode": "step", "int8": True,
               "hierarchical": False, "groups": False, "bucket_mbs": (25.0,), "tune_steps": 5, "int8_block": 64,
               "compress_intra": True, "pipeline_mb": 0.0, "connections": (1, 4), "link": "node-a,node-b",
               "cpu_reduce": True}


def _model(width=5, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)


def test_the_key_changes_with_every_input_of_the_decision():
    assert set(OTHER_VALUE) == {f.name for f in dataclasses.fields(TuneInputs)}  # a new input needs a line here
    model = _model()
    base = BASE.key(model)
    keys = {name: dataclasses.replace(BASE, **{name: value}).key(model) for name, value in OTHER_VALUE.items()}
    keys["hierarchical=True"] = dataclasses.replace(BASE, hierarchical=True).key(model)
    keys["parameter shapes"] = BASE.key(_model(width=6))
    keys["parameter dtypes"] = BASE.key(_model(dtype=torch.float64))
    keys["model class"] = BASE.key(nn.ModuleList(_model()))
    same = sorted(name for name, key in keys.items() if key == base)
    assert same == [], f"the key ignores {same}"
    assert len(set(keys.values())) == len(keys)
    assert torch.__version__ in base and base.endswith("|mode=comm")
    assert BASE.key(_model()) == base  # and nothing else: a fresh copy of the model hits


def test_inputs_from_the_comm_settings():
    comm = TuneInputs.of(CommConfig(autotune=True, bucket_mb=5.0), 4, 2, "cpu", groups=True)
    assert comm.bucket_mbs == (5.0, 50.0) and not comm.int8 and comm.hierarchical_allowed
    assert TuneInputs.of(CommConfig(compression="int8"), 4, 2, "cpu", groups=True).int8
    step = TuneInputs.of(CommConfig(perf_mode="step", tune_int8=True, hierarchical=False), 4, 2, "cpu", groups=True)
    assert step.bucket_mbs == (25.0,) and step.int8
    assert step.candidates() == [(False, "none", 1, False), (False, "fp16", 1, False), (False, "bf16", 1, False),
                                (False, "int8", 1, False)]
    both = TuneInputs.of(CommConfig(perf_mode="step", hierarchical=False), 4, 2, "cpu", groups=True,
                         connections=(1, 4), link="a,b")
    assert both.candidates() == [(False, c, k, False) for c in ("none", "fp16", "bf16") for k in (1, 4)]


@pytest.mark.parametrize("choice,inputs,why", [
    (CommChoice(False, "int8", 25.0), {}, "comm.tune_int8 is false"),
    (CommChoice(True, "fp16", 25.0), {"hierarchical": False}, "comm.hierarchical is false"),
    (CommChoice(True, "fp16", 25.0), {"groups": False}, "unavailable"),
    (CommChoice(False, "fp16", 12.0), {}, "bucket 12 MB is not among the sizes this run tries"),
    (CommChoice(False, "int4", 25.0), {}, "not one of"),
    (CommChoice(False, "none", 25.0, 4), {}, "4 connections are not among those this run sets up [1]"),
])
def test_a_choice_outside_the_runs_candidates_is_refused(choice, inputs, why):
    assert why in dataclasses.replace(BASE, **inputs).refusal(choice)


@pytest.mark.parametrize("choice", [CommChoice(True, "bf16", 5.0), CommChoice(False, "none", 50.0)])
def test_a_choice_among_the_runs_candidates_is_accepted(choice):
    assert BASE.refusal(choice) is None
    assert dataclasses.replace(BASE, int8=True).refusal(dataclasses.replace(choice, compression="int8")) is None


def test_cached_choice_refuses_an_entry_under_the_right_key(tmp_path, caplog):
    """An entry an older aiak wrote under today's key, choosing int8 the run forbids, is not applied."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cache = TuneCache(tmp_path / "tune.json")
        key = BASE.key(_model())
        cache.put_entry(key, CommChoice(False, "int8", 25.0).entry(perf_mode="comm"))
        with caplog.at_level(logging.INFO, logger="aiak"):
            assert cached_choice(cache, key, BASE) is None
        assert "cannot apply: int8 is not allowed (comm.tune_int8 is false); tuning again" in caplog.text
        assert cached_choice(cache, key, dataclasses.replace(BASE, int8=True)) == CommChoice(False, "int8", 25.0)
    finally:
        dist.destroy_process_group()


# -- two gloo ranks, a real cache file, wrap_distributed as aiak.optimize calls it -------------------------------
class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _every_entry_says_int8(path):
    """Rank 0 rewrites each entry of the cache to int8, through the cache API, as the tuner writes a choice."""
    if dist.get_rank() == 0:
        cache = TuneCache(path)
        for key in json.loads(Path(path).read_text()):
            choice = read_choice(cache, key)
            cache.put_entry(key, dataclasses.replace(choice, compression="int8").entry(perf_mode=key.rsplit("|mode=", 1)[1]))
    dist.barrier()


def _tune_with_and_without_int8(rank, world):
    from aiak.comm import wrap_distributed

    path = os.path.join(os.environ["AIAK_TEST_DIR"], "tune.json")
    said = _Said()
    logging.getLogger("aiak").addHandler(said)
    logging.getLogger("aiak").setLevel(logging.INFO)

    def run(tune_int8):
        said.messages.clear()
        ddp = wrap_distributed(_model(), CommConfig(autotune=True, bucket_mb=0.001), tune_steps=1,
                               tune_int8=tune_int8, tune_cache=path)
        dist.barrier()
        return {"compression": ddp.aiak_comm_state.compression, "describe": ddp.aiak_comm_state.describe(),
                "tuned": any("autotune (comm mode) chose" in m for m in said.messages)}

    out = {"int8 allowed": run(True)}
    _every_entry_says_int8(path)  # whatever timing chose, the earlier run's entry now says int8
    out["int8 forbidden"] = run(False)
    _every_entry_says_int8(path)  # as if an older aiak had written int8 under this run's own key
    out["int8 forbidden, entry under its own key"] = run(False)
    out["int8 allowed again"] = run(True)
    return out


@pytest.mark.slow
def test_a_run_without_tune_int8_never_takes_int8_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AIAK_TEST_DIR", str(tmp_path))
    runs = spawn_ranks(_tune_with_and_without_int8)
    for rank, r in enumerate(runs):
        assert r["int8 allowed"]["tuned"] == (rank == 0)  # a fresh cache: tuned (rank 0 logs it)
        for name in ("int8 forbidden", "int8 forbidden, entry under its own key"):
            assert r[name]["compression"] != "int8", (name, r[name]["describe"])
            assert r[name]["tuned"] == (rank == 0), name  # tuned again, not taken from the cache
        assert r["int8 allowed again"]["compression"] == "int8"  # its own entry, which says int8: a cache hit
        assert not r["int8 allowed again"]["tuned"]
    for name, run in runs[0].items():  # every rank runs what rank 0 decided
        assert runs[1][name]["describe"] == run["describe"], name
