"""Trials on 4 gloo ranks with deliberately skewed timings agree: slowest rank's time, any rank's failure."""
import torch


def test_four_skewed_ranks_agree_on_one_strategy(launch_ranks):
    results = launch_ranks("tune_skewed", world=4, timeout=150)
    decisions = [r["decision"] for r in results]
    assert all(d["strategy"] == decisions[0]["strategy"] for d in decisions)       # one strategy everywhere
    assert all(d["trials"] and not d["cache_hit"] for d in decisions)
    chosen = decisions[0]["strategy"]
    # rank 3 sleeps 150 ms per bf16 step: by the slowest rank's time, bf16 cannot win
    assert chosen["precision"]["level"] == "O0"
    trials = {t["label"]: t for t in decisions[0]["trials"]}
    bf16 = [t for t in trials.values() if t["strategy"].get("precision.level") in ("O1", "O2") and t["accepted"]]
    fp32 = [t for t in trials.values() if t["strategy"].get("precision.level") is None and t["accepted"]]
    assert bf16 and fp32 and min(t["step_ms"] for t in bf16) > 100 > max(t["step_ms"] for t in fp32)
    # rank 1 raises on channels_last inputs: every channels_last (prefetched) candidate is dropped on all ranks
    cl = [t for t in trials.values() if t["strategy"].get("channels_last")]
    assert cl and all(not t["accepted"] for t in cl)
    for d in decisions:
        assert [t["accepted"] for t in d["trials"]] == [t["accepted"] for t in decisions[0]["trials"]]
    assert chosen["channels_last"] is False
    # and the ranks then trained the same model (DDP from the same start; BatchNorm statistics stay per rank)
    w0 = {k: v for k, v in results[0]["weights"].items() if "running" not in k and "num_batches" not in k}
    assert all(all(torch.equal(r["weights"][k], w0[k]) for k in w0) for r in results[1:])
