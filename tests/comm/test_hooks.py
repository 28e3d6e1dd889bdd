"""Hierarchical allreduce and compressed hooks against DDP's own allreduce, on 4 gloo ranks (2 nodes x 2)."""
import pytest
import torch
from torch.testing import assert_close

pytestmark = pytest.mark.slow

# max |hook - DDP| / max |DDP gradient|, per tensor, per step (int8: one step's quantization error; error
# feedback carries the rest into the next step)
BOUNDS = {"fp16": 2e-3, "bf16": 1.6e-2, "int8": 0.1}


@pytest.fixture(scope="module")
def training(launch_ranks):
    return launch_ranks("training", timeout=170)


def _rel_err(got, ref):
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


def test_topology_from_torchrun_env(training):
    assert all(r["topology"] == ((0, 1), (2, 3)) for r in training)


@pytest.mark.parametrize("step", [0, 1])
def test_hierarchical_gradients_equal_flat_ddp(training, step):
    for r in training:
        for got, ref in zip(r[(True, "none")]["grads"][step], r["baseline"][step]):
            assert_close(got, ref)


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("compression", ["fp16", "bf16", "int8"])
def test_compressed_gradients_within_bounds(training, hierarchical, compression):
    for r in training:
        for step in range(2):
            err = _rel_err(r[(hierarchical, compression)]["grads"][step], r["baseline"][step])
            assert err <= BOUNDS[compression], (compression, hierarchical, step, err)
            assert err > 0, "compression had no effect on the numbers: was it applied?"


@pytest.mark.parametrize("algorithm", [(h, c) for h in (False, True) for c in ("none", "fp16", "bf16", "int8")])
def test_every_rank_gets_identical_gradients(training, algorithm):
    key = "baseline" if algorithm == (False, "none") else algorithm
    grads = [r[key] if key == "baseline" else r[key]["grads"] for r in training]
    for other in grads[1:]:
        for a, b in zip(grads[0][1], other[1]):
            assert torch.equal(a, b)


def test_hierarchical_moves_one_shard_per_local_rank_across_nodes(training):
    """Inter-node collectives carry ceil(bucket / local_size) values, on groups pairing local rank i of each node."""
    for rank, r in enumerate(training):
        calls = r[(True, "none")]["calls"]
        node_peers = (0, 1) if rank < 2 else (2, 3)
        inter_peers = (rank % 2, rank % 2 + 2)
        buckets = [n for op, ranks, n, _ in calls if op == "all_to_all"]  # intra reduce-scatter (gloo: all-to-all)
        inter = [(n, dtype) for op, ranks, n, dtype in calls if op == "all_reduce"]
        assert all(ranks == node_peers for op, ranks, _, _ in calls if op != "all_reduce")
        assert all(ranks == inter_peers for op, ranks, _, _ in calls if op == "all_reduce")
        assert buckets == [270400, 7154]  # 270399 padded to a multiple of the local size
        assert [n for n, _ in inter] == [b // 2 for b in buckets]


@pytest.mark.parametrize("step", [0, 1])
def test_pipelined_chunks_give_the_same_gradients(training, step):
    for r in training:
        for got, ref in zip(r[("pipelined", "none")]["grads"][step], r["baseline"][step]):
            assert_close(got, ref)
        assert _rel_err(r[("pipelined", "int8")]["grads"][step], r["baseline"][step]) <= BOUNDS["int8"]


def test_pipeline_cuts_buckets_into_chunks(training):
    calls = training[0][("pipelined", "none")]["calls"]
    chunk = int(0.1 * 2**20 / 4) // 2 * 2
    scatters = [n for op, _, n, _ in calls if op == "all_to_all"]
    inter = [n for op, _, n, _ in calls if op == "all_reduce"]
    assert max(scatters) == chunk and len(scatters) >= 10
    assert inter == [n // 2 for n in scatters]


@pytest.mark.parametrize("compression,wire", [("fp16", "torch.float16"), ("bf16", "torch.bfloat16")])
def test_hierarchical_compresses_only_the_inter_node_step(training, compression, wire):
    calls = training[0][(True, compression)]["calls"]
    assert {d for op, _, _, d in calls if op == "all_reduce"} == {wire}
    assert {d for op, _, _, d in calls if op != "all_reduce"} == {"torch.float32"}


def test_int8_sends_a_quarter_of_the_bytes(training):
    """ByteGrad: all-to-all + allgather of uint8 codes (+8 header bytes per 2048 values) instead of fp32."""
    flat = training[0][(False, "int8")]["calls"]
    assert {d for _, _, _, d in flat} == {"torch.uint8"}
    fp32_bytes = 4 * sum(n for op, _, n, _ in training[0][(False, "fp16")]["calls"])
    int8_bytes = sum(n for op, _, n, _ in flat if op == "all_to_all")  # the reduce-scatter phase
    assert int8_bytes < 0.26 * fp32_bytes


def test_no_sync_accumulation_matches_ddp(training):
    for r in training:
        for got, ref in zip(r["accum"]["hier"], r["accum"]["default"]):
            assert_close(got, ref)


def test_state_dict_uses_the_users_keys(training):
    keys, plain = training[0]["state_dict_keys"]
    assert keys == plain
    assert training[0]["state_dict_roundtrip"]


@pytest.mark.parametrize("name", ["hier_int8", "flat_int8"])
def test_int8_with_error_feedback_trains_like_fp32(training, name):
    for r in training:
        fp32, int8 = r["fp32"]["losses"], r[name]["losses"]
        assert fp32[-1] < 0.1 * fp32[0]  # the problem is actually being learned
        assert int8[-1] <= fp32[-1] * 1.05 + 1e-4
        w_int8 = torch.cat([w.flatten() for w in r[name]["weights"]])
        w_fp32 = torch.cat([w.flatten() for w in r["fp32"]["weights"]])
        assert float((w_int8 - w_fp32).norm() / w_fp32.norm()) < 1e-2


@pytest.mark.parametrize("name", ["fp32", "hier_int8", "flat_int8"])
def test_every_rank_ends_with_identical_weights(training, name):
    for r in training[1:]:
        for a, b in zip(training[0][name]["weights"], r[name]["weights"]):
            assert torch.equal(a, b)
