"""``aiak.optimize`` under torchrun (4 gloo ranks, 2 nodes x 2): precision, accumulation and comm together."""
import pytest
import torch


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_o2_accumulation_hierarchical_ranks_start_and_stay_identical(launch_ranks):
    results = launch_ranks("optimize", timeout=150)
    first = results[0]
    assert first["type"] == "DistributedDataParallel"
    assert first["describe"] == "DDP, hierarchical+fp16"
    for r in results:
        for k, v in r["start"].items():  # exact fp32 weights of rank 0, user keys, every rank
            assert torch.equal(v, first["rank0_start"][k]), k
        for k, v in r["end"].items():
            assert torch.equal(v, first["end"][k]), k
        assert all(torch.equal(a, b) for a, b in zip(r["masters"], first["masters"]))
    assert any(not torch.equal(first["end"][k], first["start"][k]) for k in first["end"])  # it trained
