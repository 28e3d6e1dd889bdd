"""``comm.algorithm``: local SGD, decentralized SGD and PowerSGD on real gloo ranks, each against an independent
reference (torch's own hooks and averagers, or a plain torch.distributed transcription of the arithmetic), plus
exact resume under O2 and accumulation. The ranks run tests/comm/algorithm_worker.py."""
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("algorithm_worker.py")


@pytest.fixture(scope="module")
def run(launch_ranks):
    cache = {}

    def scenario(name, **kw):
        if name not in cache:
            cache[name] = launch_ranks(name, worker=WORKER, timeout=240, **kw)
        return cache[name]

    return scenario


def _max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- local SGD ---------------------------------------------------------------------------------------
def test_local_sgd_with_period_1_is_ddp_bit_for_bit(run):
    for r in run("local_sgd"):
        assert r["period1_algorithm"] is None  # it runs as allreduce
        assert _equal(r["period1"], r["ddp"])


@pytest.mark.parametrize("variant, tolerance", [("aiak_flat", 0.0), ("aiak_hierarchical", 1e-6),
                                                ("aiak_fp16", 5e-5)])
def test_local_sgd_matches_torchs_post_local_sgd_and_periodic_averager(run, variant, tolerance):
    """Plain SGD, 2 nodes x 2 ranks, 20 steps, warm-up 3, period 4, against DDP + post_localSGD_hook(subgroup=the
    node) + PeriodicModelAverager. Flat transport is the same arithmetic (bit for bit); hierarchical averages in
    another order; fp16 transport sends the change since the last average in fp16."""
    ranks = run("local_sgd")
    for r in ranks:
        mine = r[variant]
        assert _max_diff(mine["weights"], r["torch"]) <= tolerance
        assert mine["averages"] == 5  # after steps 3, 7, 11, 15, 19
        assert not mine["broadcast_buffers"]  # DDP's per-forward buffer broadcast is off in the local phase
        assert _max_diff(mine["weights"], r["ddp20"]) > 1e-5  # and it is not DDP: the nodes drifted between averages
    # the ranks of every node, and after the last average all ranks, hold the same weights
    assert all(_equal(r["aiak_flat"]["weights"], ranks[0]["aiak_flat"]["weights"]) for r in ranks)


def test_local_sgd_averages_batchnorm_statistics_where_torchs_averager_leaves_them_per_rank(run):
    ranks = run("local_sgd")
    for r in ranks:
        params = {k: v for k, v in r["torch_bn"].items() if "running" not in k and "num_batches" not in k}
        assert _max_diff({k: r["aiak_bn"]["weights"][k] for k in params}, params) <= 1e-6  # the same training
        assert [step for step, _, _ in r["aiak_bn"]["seen"]] == [2, 5, 8, 11]
        for _, gathered, after in r["aiak_bn"]["seen"]:
            for ranks_values, averaged in zip(gathered, after):
                assert not torch.equal(ranks_values[0], ranks_values[1])  # they differed before
                assert torch.allclose(averaged, torch.stack(ranks_values).mean(0), rtol=0, atol=1e-6)
    # aiak's running statistics agree on every rank at the end (step 11 averaged); torch's differ
    key = "1.running_mean"
    assert all(torch.equal(r["aiak_bn"]["weights"][key], ranks[0]["aiak_bn"]["weights"][key]) for r in ranks)
    assert (ranks[0]["torch_bn"][key] - ranks[2]["torch_bn"][key]).abs().max() > 1e-3


def test_local_sgd_fp16_transport_keeps_batchnorm_statistics_beyond_fp16s_range_finite(run):
    # BN on features of std 3000: running_var rises by ~1e6 a period; sent as an fp16 change it became inf, then NaN
    for r in run("local_sgd_large_buffers"):
        fp16, fp32 = r["fp16"], r["none"]
        assert all(torch.isfinite(v).all() for v in fp16.values()), fp16
        assert fp32["1.running_var"].max() > 65504 * 4                  # past fp16's range, as meant
        for key in fp32:
            torch.testing.assert_close(fp16[key], fp32[key], rtol=2e-3, atol=1e-2, msg=key)   # fp16 precision


def test_a_parameter_unused_in_forward_trains_under_every_algorithm_with_find_unused_parameters(run):
    ranks = run("unused_parameters")
    for r in ranks:
        for algorithm in ("allreduce", "local_sgd", "decentralized", "powersgd"):
            assert "error" not in r[algorithm], (algorithm, r[algorithm].get("error"))
            assert r[algorithm]["find_unused"] is True
            spare = r[algorithm]["weights"]["spare.weight"]
            assert torch.equal(spare, ranks[0]["plain"]["spare.weight"])          # untouched, as under plain DDP
        # allreduce (hierarchical on 2 nodes x 2): DDP's arithmetic, up to the order of the sums
        assert _max_diff(r["allreduce"]["weights"], r["plain"]) <= 1e-6
        assert r["script_line_returns_aiaks"]


def test_uneven_inputs_under_join_run_with_allreduce_and_powersgd_and_are_refused_at_once_otherwise(run):
    # local SGD and decentralized SGD synchronise at optimizer steps that a joined rank never takes: it hung until
    # the process group's timeout; now the first join() raises on every rank, naming what to do
    for r in run("join"):
        for how in ("ddp.join", "Join"):
            assert r[("allreduce", how)] == "ran" and r[("powersgd", how)] == "ran", r
            for algorithm in ("local_sgd", "decentralized"):
                said = r[(algorithm, how)]
                assert said.startswith(f"aiak.comm: DistributedDataParallel.join() (uneven inputs) does not run "
                                       f"with comm.algorithm {algorithm}") and "the same number of batches" in said
            # counted items: the ranks out of batches aborted with gloo's "collective mismatch", the others with
            # "Connection closed by peer"; now join() raises on every rank, naming count_items
            said = r[("counted", how)]
            assert said.startswith("aiak: DistributedDataParallel.join() (uneven inputs) does not run with counted "
                                   "items") and "count_items" in said and "the same number of batches" in said, said


def test_local_sgd_on_one_rank_per_node_sends_nothing_between_averages(run):
    """4 nodes x 1 rank, warm-up 2, period 4: one allreduce per warm-up step, then one per average (steps 2 and 6:
    the weights), none on the other steps; and the same training as torch's reference with 1-rank subgroups."""
    for r in run("local_sgd_collectives", nodes=[0, 1, 2, 3]):
        assert r["per_step"] == [1, 1, 1, 0, 0, 0, 1, 0, 0, 0]
        assert _max_diff(r["aiak"]["weights"], r["torch"]) == 0.0
        assert r["aiak"]["averages"] == 5


# -- decentralized -----------------------------------------------------------------------------------
@pytest.mark.parametrize("peers", ["shift_one", "all"])
def test_decentralized_equals_a_plain_torch_distributed_transcription(run, peers):
    ranks = run("decentralized")
    for r in ranks:
        mine = r[peers]
        assert _equal(mine["aiak"], mine["reference"])  # 10 steps, SGD with momentum, bit for bit
        assert mine["exchanges"] == 10
        assert mine["describe"] == f"decentralized SGD: peers {peers}"
    # replicas agree only on average: the ranks' weights differ
    assert not _equal(ranks[0][peers]["aiak"], ranks[1][peers]["aiak"])


def test_decentralized_exchange_runs_while_the_backward_computes(run):
    """Every step's exchange began on the comm worker before that step's backward had finished (issued at the
    forward's start, a forward of 0.1 s; the step waits for it)."""
    for r in run("decentralized"):
        for peers in ("shift_one", "all"):
            started, done = r[peers]["started"], r[peers]["backward_done"]
            assert len(started) == len(done) == 3
            assert all(s < d for s, d in zip(started, done))


def test_shift_one_pairs_every_rank_with_every_rank_of_the_other_half():
    from aiak.comm.algorithms.decentralized import shift_one_peer

    for world in (2, 4, 6, 8):
        half = world // 2
        for exchange in range(2 * world):
            peers = [shift_one_peer(r, world, exchange) for r in range(world)]
            assert all(peers[peers[r]] == r and (r < half) != (peers[r] < half) for r in range(world))
        for r in range(world):
            assert {shift_one_peer(r, world, t) for t in range(half)} == \
                (set(range(half, world)) if r < half else set(range(half)))


# -- PowerSGD ----------------------------------------------------------------------------------------
def test_powersgd_gives_the_gradients_of_torchs_hook_registered_directly(run):
    """2 warm-up steps then 6 compressed, 2 nodes x 2 ranks: aiak's sums (hierarchical, or flat) add in another
    order than torch's allreduce, nothing else differs."""
    for r in run("powersgd"):
        for topology in ("hierarchical", "flat"):
            assert len(r["aiak_grads"][topology]) == len(r["torch_grads"]) == 8
            for mine, theirs in zip(r["aiak_grads"][topology], r["torch_grads"]):
                for a, b in zip(mine, theirs):  # float rounding (measured: up to 4e-6 of the largest value)
                    assert (a - b).abs().max() <= 2e-5 * b.abs().max()
            assert r["describe"][topology] == f"PowerSGD: rank 2, warm-up 2 steps, {topology} sums"


def test_powersgd_writes_each_residual_into_the_one_two_steps_before(run):
    """No allocation of a bucket-sized tensor a step: from the second compressed step on, the new residual goes
    into the memory of the one it replaced a step before (freed once that step's result was known finite)."""
    for r in run("powersgd"):
        assert r["residual_reused"] == {"hierarchical": [True] * 4, "flat": [True] * 4}


def test_powersgd_sends_two_sums_a_step_and_across_nodes_between_one_rank_per_node(run):
    """The uncompressed tensors travel with the Ps: two allreduces per compressed step where torch's hook makes
    three; hierarchical, each is an allreduce of the 2 nodes' leaders (the rest stays inside the node)."""
    for r in run("powersgd"):
        calls = r["allreduces"]  # per step, the size of each allreduce's group
        assert calls["torch"] == [[4]] * 2 + [[4, 4, 4]] * 6
        assert calls["flat"] == [[4]] * 2 + [[4, 4]] * 6
        assert calls["hierarchical"] == [[2]] * 2 + [[2, 2]] * 6


def test_powersgd_skips_one_inf_step_and_stays_finite_where_torchs_hook_stays_poisoned(run):
    """fp16 loss scaling, an inf input on rank 1 at step 4 (PowerSGD active since step 2)."""
    for r in run("powersgd"):
        guarded = r["guarded"]
        assert guarded["stepped"] == [True] * 4 + [False] + [True] * 5
        assert guarded["skipped"] == 1
        finite = [all(bool(g.isfinite().all()) for g in grads) for grads in guarded["grads"]]
        assert finite == [True] * 4 + [False] + [True] * 5
        assert all(bool(t.isfinite().all()) for t in guarded["residuals"].values())
        assert all(bool(v.isfinite().all()) for v in guarded["weights"].values())
        raw = [all(bool(g.isfinite().all()) for g in grads) for grads in r["raw_grads"]]
        assert raw == [True] * 4 + [False] * 6  # torch's hook alone: the residual is NaN for good


def test_powersgd_with_many_buckets_keeps_one_order_of_collectives_on_every_rank(run):
    """7 layers in 0.3 MB buckets: torch's hook alone issued the P and Q allreduces of buckets in flight in
    different orders on different ranks (gloo: mismatched sizes, or sums of the wrong tensors)."""
    ranks = run("powersgd")
    for step in range(6):
        for r in ranks:
            assert all(bool(g.isfinite().all()) for g in r["buckets"][step])
            assert all(torch.equal(a, b) for a, b in zip(r["buckets"][step], ranks[0]["buckets"][step]))


def test_powersgd_bucket_mb_auto_puts_the_gradients_in_one_bucket_and_a_number_cuts_them(run):
    """Each bucket costs two sums in sequence: ``auto`` sends every gradient in one bucket, and a ``comm.bucket_mb``
    (allreduce's, 0.3 there) is ignored with a warning naming the key to set; ``powersgd.bucket_mb: 0.3`` cuts the
    1.3 MB of gradients into buckets of about 0.3 MB (whole tensors of 0.25 MB each)."""
    ranks = run("powersgd")
    for r in ranks:
        assert r["bucket_count"]["auto"] == 1
        assert r["bucket_count"]["0.3"] >= 3
    assert any("comm.bucket_mb: 0.3 is the allreduce algorithms' bucket size; powersgd's is "
               "comm.powersgd.bucket_mb (auto): set that one instead" in w for w in ranks[0]["bucket_warnings"])


def test_powersgd_checkpoint_round_trip_continues_bit_for_bit(run):
    for r in run("powersgd"):
        c = r["checkpoint"]
        assert _equal(c["resumed"], c["straight"])
        assert c["extras"]["comm_algorithm"]["iter"] == 4
        assert not _equal(c["without_algorithm_state"], c["straight"])


# -- resume under O2 + accumulation ------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["local_sgd", "decentralized", "powersgd"])
def test_o2_accumulation_resume_is_bit_identical(run, algorithm):
    """O2 bf16, grad_accumulation 2, a BatchNorm MLP, 7 real steps straight against 3 + checkpoint + 4 on fresh
    objects; without the algorithm's state in the checkpoint the resumed run differs."""
    counted = {"local_sgd": ("steps", 3), "decentralized": ("exchanges", 3), "powersgd": ("iter", 3)}
    for r in run("resume"):
        c = r[algorithm]
        assert _equal(c["resumed"], c["straight"])
        state = c["extras"]["comm_algorithm"]
        assert state["algorithm"] == algorithm
        key, real_steps = counted[algorithm]
        assert state[key] == real_steps  # real steps, not the 6 micro-steps behind them
        if algorithm == "local_sgd":
            assert state["averages"] == 1  # after real step 1 (warm-up 1, period 2)
        assert not _equal(c["without_algorithm_state"], c["straight"])


@pytest.fixture(scope="module")
def fresh_resume(launch_ranks, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    saved = launch_ranks("resume_fresh", worker=WORKER, timeout=240,
                         env={"AIAK_TEST_PHASE": "save", "AIAK_TEST_DIR": folder})
    loaded = launch_ranks("resume_fresh", worker=WORKER, timeout=240,
                          env={"AIAK_TEST_PHASE": "load", "AIAK_TEST_DIR": folder})
    return saved, loaded


@pytest.mark.parametrize("name", ["int8", "int8_momentum", "int8_buckets", "int8_hierarchical", "int8_o2",
                                  "int8_two_dtypes", "powersgd"])
def test_resume_in_fresh_processes_is_bit_identical(fresh_resume, name):
    """grad_accumulation 2, a BatchNorm MLP on 2 nodes x 2 ranks: 6 real steps straight against 3 steps, a
    checkpoint per rank, and 3 more in new processes that load it with torch.load's defaults (weights only). int8
    residuals travel with their buckets' layouts, and the resumed run's first step runs the saved run's buckets
    (one bucket cut into several; hierarchical chunks; a float64 head: two initial buckets, one per dtype). Without
    the hook's state, or with the next rank's checkpoint (its residuals are that rank's own error: dropped, with a
    warning on this rank), the run differs."""
    saved, loaded = fresh_resume
    for rank, (before, after) in enumerate(zip(saved, loaded)):
        straight, c = before[name]["straight"], after[name]
        assert _equal(c["resumed"], straight), _max_diff(c["resumed"], straight)
        assert not c["resumed_warnings"]
        assert not _equal(c["without_comm_state"], straight)
        assert not _equal(c["next_ranks_checkpoint"], straight)
        if name != "powersgd":
            state = c["extras"]["comm_state"]
            assert state["rank"] == rank and state["residuals"] and state["layouts"]
            trained = [k for k in straight if "running" not in k and "num_batches" not in k]  # BN statistics are
            assert _equal(*({k: run[k] for k in trained}                                       # each rank's own
                            for run in (c["next_ranks_checkpoint"], c["without_comm_state"])))
            assert any(f"residuals are rank {(rank + 1) % 4}'s, and this is rank {rank}" in w
                       for w in c["next_ranks_checkpoint_warnings"])
        else:
            assert any(f"residuals are rank {(rank + 1) % 4}'s, and this is rank {rank}" in w
                       for w in c["next_ranks_checkpoint_warnings"])


def test_residuals_of_another_algorithm_are_dropped_saying_what_they_were_computed_with(fresh_resume):
    for r in fresh_resume[1]:
        assert r["other_algorithm"]["residuals"] == 0
        assert any("were computed with flat+int8 on 4 ranks (2 per node)" in w and "hierarchical+int8" in w
                   for w in r["other_algorithm"]["warnings"]), r["other_algorithm"]["warnings"]


def test_powersgd_generator_state_round_trips_as_tensors_and_old_checkpoints_still_load():
    """The generator's state is saved as a tensor and numbers (torch.load's weights-only reader refuses numpy
    arrays); a checkpoint written before, holding numpy's own tuple, still loads."""
    import numpy as np

    from aiak.comm.algorithms.powersgd import _rng_state, _set_rng_state

    rng = np.random.RandomState(3)
    rng.randint(10, size=5)
    saved, old_format = _rng_state(rng), rng.get_state()
    assert isinstance(saved["key"], torch.Tensor)
    expected = rng.randint(1_000_000_000, size=4)
    for state in (saved, old_format):
        other = np.random.RandomState(0)
        _set_rng_state(other, state)
        assert (other.randint(1_000_000_000, size=4) == expected).all()


# -- what cannot run, and what makes no difference ---------------------------------------------------
def test_what_cannot_run_is_refused_whole_and_what_changes_nothing_says_so(launch_ranks):
    """3 ranks on one node."""
    r = launch_ranks("refusals", worker=WORKER, world=3, nodes=[0, 0, 0], timeout=120)[0]
    one_node = r["local_sgd_one_node"]
    assert one_node["type"] == "DistributedDataParallel" and one_node["describe"] == "DDP, flat"
    assert any("local_sgd averages across nodes, and this run has one node" in w for w in one_node["warnings"])
    assert "shift_one pairs ranks, and this run has 3 (odd); use peers: all" in r["shift_one_odd"]["error"]
    assert r["all_odd"]["describe"] == "DDP, decentralized SGD: peers all"
    assert "pass the optimizer to aiak.optimize" in r["no_optimizer"]["error"]
    assert any("without the optimizer given to aiak.optimize a checkpoint leaves them out" in w
               for w in r["int8_no_optimizer"]["warnings"])  # int8 residuals: applied, and said where they travel
    assert r["int8_no_optimizer"]["type"] == "DistributedDataParallel"
    assert "needs aiak to wrap the model in DDP" in r["prewrapped"]["error"]
    assert "a second optimizer would synchronise it twice per step" in r["second_optimizer"]
    for name in ("shift_one_odd", "no_optimizer", "prewrapped"):  # all or nothing: nothing was left applied
        assert r[name]["patched"] in (False, None)
        assert r[name]["model_type"] == ("DistributedDataParallel" if name == "prewrapped" else "Sequential")
