"""NCCL's socket counts: measured by the comm autotuner in fresh processes, recorded, cached and advised.

NCCL runs only on GPUs; the measuring and advising path is the same for any variable a communication library reads
once per process, so it runs here on gloo ranks with ``GLOO_SOCKET_IFNAME`` candidates (one device, two devices, an
interface that does not exist), and the NCCL children have a row in benchmarks/gpu_check.py."""
import json
import warnings

from aiak.comm.allreduce import nccl_sockets
from aiak.comm.allreduce.autotune import CommTuning
from aiak.util.cache import TuneCache
from tests.ranks import spawn_ranks

CANDIDATES = ({}, {"GLOO_SOCKET_IFNAME": "lo,lo"}, {"GLOO_SOCKET_IFNAME": "nonexistent-if9"})


def _advise_twice(rank, world, path):
    said, out = [], []
    for _ in range(2):   # the second call reads rank 0's cache entry: nothing is measured
        record = CommTuning("comm")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            env = nccl_sockets.advise([1000, 50000], cache=TuneCache(path), key="k", record=record, rounds=2,
                                      candidates=CANDIDATES, backend="gloo", timeout_s=60)
        said.append([str(w.message) for w in caught])
        out.append({"env": env, "record": record.to_dict()})
    return {"calls": out, "said": said}


def test_candidates_are_measured_once_recorded_agreed_and_then_read_from_the_cache(tmp_path):
    path = tmp_path / "tune.json"
    results = spawn_ranks(_Advise(str(path)), world=2, timeout=240)
    first, second = results[0]["calls"]
    assert all(r["calls"] == results[0]["calls"] for r in results)     # every rank: the same figures and pick
    rows = first["record"]["candidates"]
    assert [row["candidate"] for row in rows] == ["as launched", "GLOO_SOCKET_IFNAME=lo,lo",
                                                  "GLOO_SOCKET_IFNAME=nonexistent-if9"]
    assert all(row["set"] == nccl_sockets.PASS for row in rows)
    assert all(0 < row["ms_spread"][0] <= row["ms"] <= row["ms_spread"][1] for row in rows[:2])
    assert rows[2]["ms"] is None and "nonexistent-if9" in rows[2]["error"] and not rows[2]["chosen"]
    assert sum(row["chosen"] for row in rows) == 1
    chosen = next(i for i, row in enumerate(rows) if row["chosen"])
    assert first["env"] == CANDIDATES[chosen]
    # more connections are kept only when at least 10% faster than the launch's own setting
    assert chosen == 0 or rows[1]["ms"] * 1.1 < rows[0]["ms"]
    entry = json.loads(path.read_text())["k"]
    assert entry["env"] == first["env"]
    assert second["env"] == first["env"] and second["record"]["candidates"] == []
    advised = [m for m in results[0]["said"][0] if "set them in the job's environment" in m]
    assert len(advised) == (1 if first["env"] else 0)
    assert (first["record"]["advice"] != "") == bool(first["env"])


class _Advise:
    """A picklable worker for spawn_ranks holding the cache path."""

    def __init__(self, path):
        self.path = path

    def __call__(self, rank, world):
        return _advise_twice(rank, world, self.path)


def test_measured_only_for_nccl_across_nodes_with_the_variables_unset():
    assert nccl_sockets.measured_here("nccl", True, True, environ={})
    assert nccl_sockets.measured_here("cpu:gloo,cuda:nccl", True, True, environ={})
    assert not nccl_sockets.measured_here("gloo", False, True, environ={})
    assert not nccl_sockets.measured_here("nccl", True, False, environ={})          # one node: no sockets
    assert not nccl_sockets.measured_here("nccl", True, True, environ={"NCCL_SOCKET_NTHREADS": "4"})  # the user's
    assert nccl_sockets.label({}) == "as launched"
    assert nccl_sockets.label(nccl_sockets.CANDIDATES[2]) == "NCCL_SOCKET_NTHREADS=4 NCCL_NSOCKS_PERTHREAD=4"
