"""aiak.util.cache.TuneCache.key: the one way both tuners name their entries."""
from aiak.util.cache import TuneCache


def test_fields_are_readable_in_order_and_the_digest_follows_every_value():
    key = TuneCache.key("comm", "Net-1a2b", {"world": 4, "torch": "2.14.1", "mode": "step"})
    assert key == "comm|Net-1a2b|world=4|torch=2.14.1|mode=step"
    parts = {"model": "sha-of-structure", "batch": [16, 3, 32, 32], "profiles": "abc"}
    digested = TuneCache.key("strategy", "Net", digest_of=parts)
    kind, subject, digest = digested.split("|")
    assert (kind, subject, len(digest)) == ("strategy", "Net", 24)
    assert TuneCache.key("strategy", "Net", digest_of=dict(reversed(list(parts.items())))) == digested  # order-free
    for name in parts:
        assert TuneCache.key("strategy", "Net", digest_of={**parts, name: "other"}) != digested, name


def test_both_tuners_key_their_entries_through_it(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from aiak.comm.allreduce.autotune import cache_key
    from aiak.tune.trials import decision_key

    model = torch.nn.Linear(4, 2)
    assert cache_key(model, 2, 1, "cpu", "comm").startswith("comm|Linear-")

    class Probes:
        def to_dict(self):
            return {"device": "cpu", "world_size": 1}

    class Tune:
        candidates, steps, max_seconds = 4, 3, None

    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), batch_size=4)
    key = decision_key(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, Probes(), "digest", Tune())
    assert key.startswith("strategy|Linear|") and len(key.split("|")[2]) == 24
