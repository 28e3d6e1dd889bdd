"""Under torchrun, a script that wraps the model in DDP itself after the aiak line (torchvision's and timm's
reference scripts) gets one DDP: aiak's, with ``model.module`` the script's model. It once built DDP(DDP): every
gradient all-reduced by two reducers, and ``model.module`` aiak's DDP (an EMA copy of it failed to pickle a
lock)."""
import pytest
import torch


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_scripts_ddp_line_after_optimize_returns_aiaks_ddp(launch_ranks):
    results = launch_ranks("script_ddp_after_aiak", world=2, nodes=[0, 0], timeout=120)
    for rank, r in enumerate(results):
        plain = r["plain"]
        for name in ("default", "accum2"):
            run = r[name]
            assert run["is_aiaks"] and run["module_is_user_model"] and run["ddp_count"] == 1, (rank, name, run)
            assert run["ema_copied"] and run["broadcast_buffers"] is False
        # "default" communicates exactly as plain DDP: no hook, the same buckets, the same weights bit for bit
        assert r["default"]["comm_hooks"] == plain["comm_hooks"] == 0
        assert r["default"]["bucket_bytes"] == plain["bucket_bytes"]
        for k, v in plain["end"].items():
            assert torch.equal(r["default"]["end"][k], v), (rank, k)
            assert torch.equal(v, results[0]["plain"]["end"][k]), (rank, k)  # ranks agree
            # accumulation 2 over 8 batches: 4 real steps on pairs; it trained, and ranks agree
            assert torch.equal(r["accum2"]["end"][k], results[0]["accum2"]["end"][k]), (rank, k)
        assert "find_unused_parameters=True" in r["find_unused_error"]
