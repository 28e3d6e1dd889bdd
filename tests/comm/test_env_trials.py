"""Environment candidates timed in fresh processes (:mod:`aiak.comm.allreduce.env_trials`), on real gloo ranks.

``GLOO_SOCKET_IFNAME`` is read when a gloo group is created: ``lo`` gives one device, ``lo,lo`` two, and an
interface that does not exist makes the group's creation fail (``Unable to find address for: ...``).
"""
import dataclasses
import math
import os
from pathlib import Path

import pytest

from aiak.comm.allreduce.env_trials import EnvTrial, time_env_candidates
from tests.ranks import spawn_ranks

CANDIDATES = [{"GLOO_SOCKET_IFNAME": "lo"}, {"GLOO_SOCKET_IFNAME": "lo,lo"},
              {"GLOO_SOCKET_IFNAME": "nonexistent-if9"}]
BUCKETS = [1000, 50000]


def _trial_children() -> list:
    """This process's child processes that run a trial (zombies included: a child not waited for is left)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue   # gone meanwhile
        if ppid == os.getpid() and (b"aiak.comm.allreduce.env_trials" in cmdline or not cmdline):
            found.append(int(stat.parent.name))
    return found


def _three_candidates(rank, world):
    trials = time_env_candidates(CANDIDATES, BUCKETS, backend="gloo", rounds=2, timeout_s=60)
    return {"trials": [dataclasses.asdict(t) for t in trials], "medians": [t.median for t in trials],
            "left": _trial_children()}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_three_candidates, world=2, timeout=120)


@pytest.mark.slow
def test_working_candidates_get_the_slowest_ranks_seconds_for_every_timed_round(ranks):
    for r in ranks:
        for trial, median in zip(r["trials"][:2], r["medians"]):
            assert trial["error"] == "" and len(trial["seconds"]) == 2 and all(s > 0 for s in trial["seconds"])
            assert 0 < median < math.inf


@pytest.mark.slow
def test_the_children_run_with_the_candidates_environment(ranks):
    for r in ranks:
        assert [t["env_seen"] for t in r["trials"][:2]] == CANDIDATES[:2]


@pytest.mark.slow
def test_a_candidate_that_fails_at_init_is_dropped_with_its_reason(ranks):
    for r in ranks:
        failed = r["trials"][2]
        assert failed["seconds"] == [] and "nonexistent-if9" in failed["error"] and r["medians"][2] == math.inf


@pytest.mark.slow
def test_every_rank_gets_the_same_results_and_no_child_is_left(ranks):
    assert ranks[0]["trials"] == ranks[1]["trials"]
    assert [r["left"] for r in ranks] == [[], []]


@pytest.mark.slow
def test_a_single_process_times_children_of_world_one_and_removes_a_none_variable(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)   # the children find rank 0 by the host name
    monkeypatch.setenv("AIAK_ENV_TRIAL_PROBE", "set in the parent")
    before = set(_trial_children())   # other tests' children of this pytest process are not this call's
    [trial] = time_env_candidates([{"AIAK_ENV_TRIAL_PROBE": None}], [10], backend="gloo", rounds=1, timeout_s=60)
    assert trial == EnvTrial({"AIAK_ENV_TRIAL_PROBE": None}, trial.seconds, "", {"AIAK_ENV_TRIAL_PROBE": None})
    assert len(trial.seconds) == 1 and trial.median == trial.seconds[0] > 0
    assert set(_trial_children()) <= before


def test_nothing_to_time_is_refused():
    with pytest.raises(ValueError, match="rounds >= 1"):
        time_env_candidates([{}], [10], backend="gloo", rounds=0)
