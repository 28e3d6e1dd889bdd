"""The decision table groups knobs by what set them (the source and its reason once, then the knobs), the full
table stays complete, and the headline says in one or two lines what was applied and where to read why."""
import torch
from torch.utils.data import DataLoader, TensorDataset

import aiak
from aiak.api import explain
from aiak.util.text import yaml_text
from tests.tune.test_trial_loss import NeedsAMask
from tests.tune.test_trials import TUNED, setup


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


def test_headline_says_what_was_applied_and_where_to_read_why():
    model, optimizer, loader = setup()
    aiak.optimize(model, optimizer, loader, strategy=TUNED)
    decision = aiak.last_decision()
    d = decision.to_dict()
    headline = decision.headline()
    assert 1 <= len(headline.splitlines()) <= 2
    assert "aiak explain" in headline and "aiak.last_decision()" in headline
    chosen = next(t["label"] for t in d["trials"] if "chosen" in t["why"])
    assert f"{chosen!r}" in headline and f"{len(d['trials'])} measured" in headline
    for path, knob in d["knobs"].items():
        compact = f"{path}={yaml_text(knob['value'])}"
        if knob["source"] != "default" and not path.startswith("tune."):
            assert compact in headline, compact
        elif knob["source"] == "default":
            assert compact not in headline, compact


def test_headline_says_when_nothing_was_measured():
    torch.manual_seed(0)
    model = NeedsAMask(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3, 16, 16)
    aiak.optimize(model, optimizer, DataLoader(TensorDataset(x, x), batch_size=8), strategy=TUNED)
    headline = aiak.last_decision().headline()
    assert "every candidate failed" in headline and "chose" not in headline
    model, optimizer, _ = setup()
    aiak.optimize(model, optimizer, None, strategy=TUNED)
    assert "trials skipped" in aiak.last_decision().headline()
