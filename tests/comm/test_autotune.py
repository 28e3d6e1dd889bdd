"""Autotuner: cache file behaviour (single process) and rank agreement + cache hit on 4 gloo ranks."""
import json

import pytest
import torch
import torch.nn as nn

from aiak.comm.allreduce.autotune import CommChoice, cache_key, gradient_bucket_sizes, read_choice
from aiak.comm.allreduce.connections import AUTO_CANDIDATES
from aiak.util.cache import TuneCache
from aiak.util.cache import default_cache_path


def test_cache_roundtrip_and_atomic_merge(tmp_path):
    cache = TuneCache(tmp_path / "sub" / "tune.json")
    assert read_choice(cache, "k") is None
    cache.put_entry("k", CommChoice(True, "fp16", 25.0).entry(perf_mode="comm"))
    cache.put_entry("other", CommChoice(False, "none", 5.0).entry())
    assert read_choice(cache, "k") == CommChoice(True, "fp16", 25.0)
    assert set(json.loads(cache.path.read_text())) == {"k", "other"}
    assert [p.name for p in cache.path.parent.iterdir()] == ["tune.json"]  # no temp files left behind


def test_a_corrupt_cache_is_said_by_rank_0_only(tmp_path, monkeypatch):
    """Every rank reads the cache; the warning came from each of them (issue 14: rank 0 speaks, once)."""
    import warnings

    path = tmp_path / "tune.json"
    path.write_text("{not json")
    monkeypatch.setenv("RANK", "1")  # torchrun's rank, before a process group exists
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert read_choice(TuneCache(path), "k") is None
    assert [str(w.message) for w in said if "tuning cache" in str(w.message)] == []
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="ignoring unreadable tuning cache"):
        read_choice(TuneCache(path), "k")


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    cache = TuneCache(path)
    with pytest.warns(UserWarning, match="ignoring unreadable tuning cache"):
        assert read_choice(cache, "k") is None
    with pytest.warns(UserWarning):
        cache.put_entry("k", CommChoice(False, "bf16", 25.0).entry())
    assert read_choice(cache, "k") == CommChoice(False, "bf16", 25.0)
    path.write_text(json.dumps({"k": {"hierarchical": True}}))
    with pytest.warns(UserWarning, match="malformed"):
        assert read_choice(cache, "k") is None


def test_cache_location_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AIAK_TUNE_CACHE", str(tmp_path / "x.json"))
    assert default_cache_path() == tmp_path / "x.json"


def test_cache_key_changes_with_shapes_class_world_and_device():
    a, b = nn.Linear(4, 5), nn.Linear(4, 6)
    keys = {cache_key(a, 4, 2, "cpu", "comm"), cache_key(b, 4, 2, "cpu", "comm"), cache_key(a, 8, 2, "cpu", "comm"),
            cache_key(a, 4, 4, "cpu", "comm"), cache_key(a, 4, 2, "cuda", "comm"),
            cache_key(nn.Sequential(nn.Linear(4, 5)), 4, 2, "cpu", "comm")}
    assert len(keys) == 6
    assert torch.__version__ in cache_key(a, 4, 2, "cpu", "comm")


def test_gradient_bucket_sizes_follow_ddp_order():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # 65792 params (257 KB) per layer
    assert gradient_bucket_sizes(model, 0.25) == [65792, 65792]  # each layer alone reaches 0.25 MB
    assert gradient_bucket_sizes(model, 100) == [2 * 65792]
    assert gradient_bucket_sizes(model, 0.3) == [2 * 65792]


@pytest.mark.slow
def test_ranks_agree_and_a_second_run_hits_the_cache(launch_ranks, tmp_path):
    env = {"AIAK_TUNE_CACHE": str(tmp_path / "tune.json")}
    first = launch_ranks("autotune", env=env, timeout=150)
    for mode in ("comm", "step"):
        assert len({str(r[mode]["choice"]) for r in first}) == 1, f"ranks disagree in {mode} mode"
    assert len({r["comm"]["bucket_mb"] for r in first}) == 1
    # 6 algorithms x 2 connection counts (comm.connections: auto across 2 nodes) x (warm-up + 1 timed step),
    # decided at the next step
    assert first[0]["step"]["tuned_at"] == 6 * len(AUTO_CANDIDATES) * 2 + 1
    for rank, r in enumerate(first):  # every rank decides the same; rank 0 alone logs it (issue 14)
        assert not any("cache hit" in m for m in r["logs"])
        assert sum("autotune (comm mode) chose" in m for m in r["logs"]) == (rank == 0)
        assert sum("autotune (step mode) chose" in m for m in r["logs"]) == (rank == 0)
    # the decision record holds every candidate measured, the slowest rank's figures, the same on every rank
    for name, passes in (("comm_record", {"algorithms": 8, "connections": 2, "bucket sizes": 3}),
                         ("step_record", {"steps": 6 * len(AUTO_CANDIDATES)})):
        record = first[0][name]
        assert all(r[name] == record for r in first) and not record["cache_hit"]
        for pass_name, n in passes.items():
            rows = [c for c in record["candidates"] if c["set"] == pass_name]
            assert len(rows) == n and sum(c["chosen"] for c in rows) == 1
            assert all(0 < c["ms_spread"][0] <= c["ms"] <= c["ms_spread"][1] for c in rows)
        assert record["chosen"] == next(c["candidate"] for c in rows if c["chosen"])   # the last pass's winner
    assert first[0]["comm_record"]["chosen"].startswith(first[0]["comm"]["choice"])
    assert first[0]["step_record"]["chosen"].startswith(first[0]["step"]["choice"])
    cached = json.loads(first[0]["cache"])
    assert {k.rsplit("|", 1)[1] for k in cached} == {"mode=comm", "mode=step"}

    second = launch_ranks("autotune", env=env, timeout=150)
    for rank, r in enumerate(second):
        assert sum("cache hit" in m for m in r["logs"]) == (2 if rank == 0 else 0)
        assert not any("chose" in m for m in r["logs"])
        assert r["step"]["tuned_at"] == 0  # no tuning steps
    assert second[0]["comm"] == first[0]["comm"]
    assert second[0]["comm_record"]["cache_hit"] and not second[0]["comm_record"]["candidates"]
    assert second[0]["comm_record"]["chosen"] == first[0]["comm_record"]["chosen"]
    assert second[0]["step"]["choice"] == first[0]["step"]["choice"]


@pytest.mark.parametrize("backend,device_type", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cpu"),
                                                 ("cuda:nccl", "cuda"), ("mpi", "cpu")])
def test_tuner_tensors_go_where_the_backend_can_take_them(backend, device_type):
    """NCCL has no CPU path: decide(), the cache broadcast and the timing buffers must use CUDA tensors there."""
    from aiak.util.dist import device_type_for_backend

    assert device_type_for_backend(backend) == device_type


def test_decide_and_cache_lookup_on_a_gloo_group_use_cpu(tmp_path):
    import torch.distributed as dist

    from aiak.comm.allreduce.autotune import decide, read_choice
    from aiak.util.dist import rank0_object
    from aiak.util.dist import group_device

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert group_device() == torch.device("cpu")
        assert decide([3.0, 1.0, 2.0]) == 1
        # more connections are kept only when clearly faster than the first (simplest) candidate
        assert decide([1.0, 0.95], keep_first_within=0.1) == 0 and decide([1.0, 0.85], keep_first_within=0.1) == 1
        cache = TuneCache(tmp_path / "tune.json")
        cache.put_entry("k", CommChoice(False, "fp16", 5.0).entry())
        assert rank0_object(lambda: read_choice(cache, "k")) == CommChoice(False, "fp16", 5.0)
    finally:
        dist.destroy_process_group()


def _record_algorithms(monkeypatch, state):
    """The real ``set_route``, with each call's algorithm written down in order."""
    seen = []
    real = type(state).set_route

    def recording(self, hierarchical, compression, connections=1, cpu_reduce=False):
        seen.append((hierarchical, compression, connections, cpu_reduce))
        return real(self, hierarchical, compression, connections, cpu_reduce)

    monkeypatch.setattr(type(state), "set_route", recording)
    return seen


def test_comm_mode_times_the_candidates_in_alternating_rounds(tmp_path, monkeypatch):
    """Each candidate is warmed up once, then every round runs every candidate, the order rotating: no candidate
    takes all its samples in one stretch of the machine's (or the link's) time, as back-to-back timing did."""
    import torch.distributed as dist

    from aiak.comm import CommState
    from aiak.comm.allreduce.autotune import algorithm_candidates, tune_comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        state = CommState()
        seen = _record_algorithms(monkeypatch, state)
        tune_comm(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)), state, [1.0], allow_int8=False, repeats=3)
    finally:
        dist.destroy_process_group()
    algos = algorithm_candidates(False, False)
    n = len(algos)
    timed = seen[n:n + 3 * n]                          # after one warm-up step each, 3 rounds of n steps
    assert seen[:n] == algos
    assert [sorted(timed[r * n:(r + 1) * n]) for r in range(3)] == [sorted(algos)] * 3   # every round runs all
    assert len({tuple(timed[r * n:(r + 1) * n]) for r in range(3)}) == 3                # in a rotated order
    assert seen[-1] in algos and len(seen) == 4 * n + 1  # and the winner is set at the end


def test_step_mode_rotates_the_candidates_from_step_to_step(tmp_path, monkeypatch):
    """The step tuner runs one warm-up step per candidate, then rounds of one step each in a rotating order
    (not ``tune_steps`` steps of one candidate, then the next), through a real DDP and aiak's hook."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiak.comm import CommState, StepTuner, comm_hook
    from aiak.comm.allreduce.autotune import algorithm_candidates

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        state = CommState()
        candidates = algorithm_candidates(False, False)
        state.tuner = StepTuner(candidates, steps=2, bucket_mb=25.0)
        seen = _record_algorithms(monkeypatch, state)
        model = DDP(nn.Linear(8, 2))
        model.register_comm_hook(state, comm_hook)
        for _ in range(3 * len(candidates) + 2):
            model(torch.randn(4, 8)).sum().backward()
    finally:
        dist.destroy_process_group()
    n = len(candidates)
    assert seen[:n] == candidates                                 # one warm-up step each
    rounds = [seen[n + r * n:n + (r + 1) * n] for r in range(2)]
    assert all(sorted(r) == sorted(candidates) for r in rounds) and rounds[0] != rounds[1]
    assert state.tuner is None and len(seen) == 3 * n + 1       # decided at the next step, the winner set
