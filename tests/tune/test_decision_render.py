"""The decision table groups knobs by what set them (the source and its reason once, then the knobs), the full
table stays complete, and the headline says in one or two lines what was applied and where to read why."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import aiak
from aiak.api import explain
from aiak.strategy.schema import Strategy
from aiak.strategy.select import leaves
from aiak.tune.decision import candidate_words
from aiak.util.text import yaml_text
from tests.tune.test_trial_loss import NeedsAMask
from tests.tune.test_trials import TUNED, UNGUARDED, setup


def _groups(text):
    """{heading line: [knob lines under it]} of the knob section of ``render()``."""
    groups, current = {}, None
    for line in text.splitlines()[1:]:
        if line.startswith("    ") and current is not None:
            groups[current].append(line.strip())
        elif line.startswith("  from "):
            current = line.strip()
            groups[current] = []
        else:
            current = None
    return groups


def test_knobs_set_by_one_profile_share_one_heading_with_its_reason():
    decision = explain(*setup())                                   # auto, rules only
    text = decision.render()
    shown = {p: k for p, k in decision.knobs.items() if k["source"] != "default"}
    by_source = {}
    for path, knob in shown.items():
        by_source.setdefault(knob["source"], []).append(path)
    assert any(len(paths) >= 3 for paths in by_source.values())     # auto_base sets prefetch and tune.*: a group
    groups = _groups(text)
    assert len(groups) == len(by_source)
    for source, paths in by_source.items():
        reason = shown[paths[0]]["reason"]
        assert text.count(reason) == 1, source                       # each reason once ...
        heading = next(h for h in groups if h.startswith(f"from {source}:"))
        assert reason in heading
        assert sorted(row.split()[0] for row in groups[heading]) == sorted(paths)   # ... its knobs under it
        for row in groups[heading]:
            assert row.split()[1] == yaml_text(shown[row.split()[0]]["value"]).split()[0]


def test_knobs_with_their_own_reason_keep_it_after_the_shared_words():
    decision = explain(*setup(), strategy="swin")                  # "set by profile 'swin' (default: X)"
    groups = _groups(decision.render())
    (heading, rows), = groups.items()
    assert heading == "from profile:swin: set by profile 'swin'"
    rows = {row.split()[0]: row for row in rows}
    assert set(rows) == {p for p, k in decision.knobs.items() if k["source"] != "default"}
    assert rows["precision.level"].endswith("(default: O0)") and rows["tf32"].endswith("(default: false)")


def test_full_render_lists_every_knob_with_value_source_and_reason():
    decision = explain(*setup())
    lines = decision.render(full=True).splitlines()
    for path, knob in decision.knobs.items():
        row = next(line for line in lines if line.split() and line.split()[0] == path)
        assert yaml_text(knob["value"]) in row and knob["source"] in row and row.endswith(knob["reason"]), row


@pytest.mark.parametrize("strategy", [UNGUARDED, TUNED])   # timed on copies; in the run
def test_headline_says_what_was_applied_and_where_to_read_why(strategy):
    model, optimizer, loader = setup()
    aiak.optimize(model, optimizer, loader, strategy=strategy)
    decision = aiak.last_decision()
    d = decision.to_dict()
    headline = decision.headline()
    assert 1 <= len(headline.splitlines()) <= 2
    assert "aiak explain" in headline and "aiak.last_decision()" in headline
    if strategy is UNGUARDED:
        chosen = next(t["label"] for t in d["trials"] if "chosen" in t["why"])
        assert candidate_words(chosen, d["trials"]) in headline and f"{len(d['trials'])} measured" in headline
    else:
        kept = sum(t["accepted"] for t in d["trials"])
        assert f"trials kept {kept} of {len(d['trials'])} candidates, timed in the run's first steps" in headline
    plain = dict(leaves(Strategy().to_dict()))
    for path, knob in d["knobs"].items():
        compact = f"{path}={yaml_text(knob['value'])}"
        half_dtype = path == "precision.dtype" and d["knobs"]["precision.level"]["value"] != "O0"
        if half_dtype or (knob["source"] != "default" and not path.startswith("tune.") and knob["value"] != plain[path]):
            assert compact in headline, compact
        elif knob["source"] == "default" or knob["value"] == plain[path]:
            assert compact not in headline, compact


def test_headline_lists_only_what_was_applied_and_says_what_was_skipped_and_why():
    # On a CPU, a CNN: TF32 has no CUDA to act on and window attention no module to fuse. Neither is "applied".
    model, optimizer, loader = setup()
    with pytest.warns(UserWarning):
        aiak.optimize(model, optimizer, loader, strategy={"tf32": True, "fused_ops": ["window_attention"],
                                                          "channels_last": True})
    first = aiak.last_decision().headline().splitlines()[0]
    applied, _, skipped = first.partition("; skipped: ")
    assert "channels_last=true" in applied and "tf32" not in applied and "fused_ops" not in applied, first
    assert "tf32 (no CUDA: model on cpu)" in skipped and "fused_ops (no module of DemoNet to fuse for " \
        "window_attention)" in skipped, first


def test_headline_names_no_half_dtype_beside_level_O0_and_always_the_half_dtype_beside_O1_or_O2():
    model, optimizer, loader = setup()
    aiak.optimize(model, optimizer, loader, strategy={"precision": {"level": "O0", "dtype": "fp16"}})
    d = aiak.last_decision()
    assert d.knobs["precision.dtype"]["value"] == "fp16" and d.knobs["precision.dtype"]["source"] == "user"
    assert "precision" not in d.headline() and ": plain PyTorch" in d.headline()
    model, optimizer, loader = setup()
    aiak.optimize(model, optimizer, loader, strategy={"precision": {"level": "O2"}})   # bf16: the default dtype
    first = aiak.last_decision().headline().splitlines()[0]
    assert "precision.level=O2" in first and "precision.dtype=bf16" in first, first


def test_headline_says_when_nothing_was_measured():
    torch.manual_seed(0)
    model = NeedsAMask(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3, 16, 16)
    with pytest.warns(UserWarning, match="every candidate failed"):
        aiak.optimize(model, optimizer, DataLoader(TensorDataset(x, x), batch_size=8), strategy=TUNED)
    headline = aiak.last_decision().headline()
    assert "every candidate failed" in headline and "chose" not in headline
    model, optimizer, _ = setup()
    aiak.optimize(model, optimizer, None, strategy=TUNED)
    assert "trials skipped" in aiak.last_decision().headline()


def test_the_comm_autotuners_candidates_are_in_the_record_and_its_table():
    """What the comm autotuner measured reaches ``last_decision()`` like the trials' rows: read when asked, so a
    step-mode choice made after ``optimize()`` returned shows."""
    from dataclasses import replace

    from aiak.comm.allreduce.autotune import CommChoice, CommTuning

    record = CommTuning("step")
    decision = replace(explain(*setup()), comm=record)
    assert decision.to_dict()["comm"]["chosen"] == "" and "measuring during the first steps" in decision.render()
    flat, hier = CommChoice(False, "none", 25.0), CommChoice(True, "fp16", 25.0, 1, True)
    record.add("steps", [flat.describe(), hier.describe()], [(0.020, 0.019, 0.024), (0.012, 0.011, 0.013)], best=1)
    record.add("NCCL sockets", ["NCCL's default", "4 x 4"], [(0.5, 0.4, 0.6), None], best=0,
               errors=["", "rank 1: no result within 60 s"])
    record.advice = "set NCCL_SOCKET_NTHREADS=4"
    record.chosen = hier.describe()
    as_dict = decision.to_dict()["comm"]
    assert as_dict["chosen"] == "hierarchical (CPU-Reduce)+fp16, bucket 25 MB"
    assert [c["ms"] for c in as_dict["candidates"]] == [20.0, 12.0, 500.0, None]
    assert as_dict["candidates"][1]["ms_spread"] == [11.0, 13.0] and as_dict["candidates"][1]["chosen"]
    text = decision.render()
    assert "comm autotune (step mode): chose hierarchical (CPU-Reduce)+fp16, bucket 25 MB" in text
    assert "12.00 ms (11.00-13.00)  chosen" in text and "20.00 ms (19.00-24.00)" in text
    assert "failed: rank 1: no result within 60 s" in text and "advice: set NCCL_SOCKET_NTHREADS=4" in text
