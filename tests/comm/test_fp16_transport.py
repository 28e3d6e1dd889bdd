"""fp16 on the wire past its range: every sum aiak casts to fp16 for (flat, several connections, hierarchical across
nodes, compress_intra in the node, CPU-Reduce's host copies) is made again in the values' own dtype when it comes
out inf or NaN, on every rank alike, and costs no collective while the values fit. The ranks run
tests/comm/dist_worker.py's ``fp16_overflow``."""
import pytest
import torch

VARIANTS = ["flat", "flat_4_connections", "hierarchical", "compress_intra", "cpu_reduce"]


@pytest.fixture(scope="module")
def ranks(launch_ranks):
    return launch_ranks("fp16_overflow", world=4, timeout=180)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_sum_past_fp16s_range_is_made_again_and_equals_the_uncompressed_one(ranks, variant):
    for r in ranks:
        past, plain = r[(variant, "past", "fp16")], r[(variant, "past", "none")]
        assert torch.isfinite(past["result"]).all()
        assert torch.equal(past["result"], plain["result"])  # the same algorithm's sum in float32, bit for bit
        assert len(past["calls"]) > len(r[(variant, "fit", "fp16")]["calls"])  # the sum made again
        assert any(dtype == "torch.float16" for *_, dtype in past["calls"])    # fp16 was tried first


@pytest.mark.parametrize("variant", VARIANTS)
def test_values_that_fit_travel_in_fp16_with_no_collective_added(ranks, variant):
    for r in ranks:
        fit, plain = r[(variant, "fit", "fp16")], r[(variant, "fit", "none")]
        assert [c[:3] for c in fit["calls"]] == [c[:3] for c in plain["calls"]]  # the same collectives and sizes
        assert "torch.float16" in {c[3] for c in fit["calls"]}
        assert not torch.equal(fit["result"], plain["result"])                   # really sent as fp16...
        torch.testing.assert_close(fit["result"], plain["result"], rtol=2e-3, atol=0.1)  # ...at fp16 precision


@pytest.mark.parametrize("hierarchical", [False, True])
def test_training_with_fp16_compression_survives_a_gradient_past_65504(ranks, hierarchical):
    """An fp32 linear model, comm.compression fp16, rank 1's inputs x1e4 at step 2: its gradients reach ~1e7. The
    weights stay finite and match the uncompressed run at fp16 precision (they became NaN on every rank)."""
    for r in ranks:
        fp16, fp32 = r[("training", "fp16", hierarchical)], r[("training", "none", hierarchical)]
        for key in fp32:
            assert torch.isfinite(fp16[key]).all(), key
            torch.testing.assert_close(fp16[key], fp32[key], rtol=1e-3, atol=1e-6, msg=key)
