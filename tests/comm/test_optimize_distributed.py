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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_o2_on_a_model_the_script_wrapped_in_ddp_equals_aiaks_own_wrapping(launch_ranks):
    """2 gloo ranks: ``aiak.optimize(DistributedDataParallel(model), ...)`` under O2 bf16 returns the script's DDP
    (its ``module`` the script's model, its fp32 parameters untouched) with aiak's communication hook registered
    (gradients travel in bf16, as under aiak's own wrapping), and trains to bit-identical weights as aiak's usual
    order on every rank: the same DDP buckets (DDP's defaults both ways), the same bf16 hook, the same reductions.
    With ``grad_accumulation: 2`` too (no allreduce on micro-steps either way)."""
    results = launch_ranks("prewrapped_o2", world=2, nodes=[0, 0], timeout=120)
    first = results[0]
    for r, result in enumerate(results):
        for name in ("o2", "o2_accum2"):
            script, aiak_order = result[name]["script_ddp_first"], result[name]["aiak_wraps"]
            assert script["returned_is_script_ddp"] and script["module_is_script_model"], (r, name)
            assert script["comm_hooks"] == 1 and script["compression"] == "bf16", (r, name)
            assert script["describe"] == aiak_order["describe"] == "flat+bf16", (r, name)
            assert aiak_order["type"] == "DistributedDataParallel"
            assert not [w for w in script["warnings"] if "DistributedDataParallel" in w], script["warnings"]
            assert script["dtypes"] == aiak_order["dtypes"] == ["torch.float32"]
            for k, v in script["end"].items():
                assert torch.equal(v, aiak_order["end"][k]), (r, name, k)  # the two orders, on this rank
                assert torch.equal(v, first[name]["script_ddp_first"]["end"][k]), (r, name, k)  # every rank
            assert any(not torch.equal(v, first["rank0_start"][k]) for k, v in script["end"].items())  # it trained
