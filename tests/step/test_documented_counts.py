"""The ``count_items`` examples the quickstart documents are exact for the model family each names: a window of
micro-batches counted with them equals one step on the big batch, on real Hugging Face models (random weights).

Each example is read from ``docs/quickstart.md`` (the comment above it names the family), so what a user copies is
what is tested. Tolerance: weights to 1e-6 after one SGD step at learning rate 1 (float32 sums in another order);
the control, the other family's count, is off by more than 1e-5."""
import copy
import re
import warnings
from pathlib import Path

import pytest
import torch

import aiak

transformers = pytest.importorskip("transformers")

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"
VOCAB, LENGTH, BATCH, MICRO_BATCHES = 64, 12, 2, 4


def documented_counts():
    """``{family: count function}`` for each ``count_items=lambda batch: ...`` of the quickstart, the family being
    the first of "causal" or "masked" in the comment lines above it (since the code block or the last example)."""
    counts, comment = {}, ""
    for line in QUICKSTART.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# "):
            comment += " " + stripped
            continue
        found = re.search(r"count_items=(lambda batch: .*)\)\s*$", stripped)
        if found:
            family = next(f for f in ("causal", "masked") if f in comment)
            counts[family] = eval(found.group(1))  # noqa: S307 - the project's own documentation
        if found or stripped.startswith("```"):
            comment = ""
    return counts


def _model(family):
    torch.manual_seed(0)
    if family == "causal":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=LENGTH,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _batches(family):
    """Micro-batches of padded sequences (2 to 12 tokens) whose labels are -100 on the padding, and for a masked LM
    also on the tokens not masked: each micro-batch holds a different number of counted tokens."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=g)
        real = torch.arange(LENGTH)[None, :] < lengths[:, None]
        labels = ids.masked_fill(~real, -100)
        if family == "masked":
            labels = labels.masked_fill(torch.rand(BATCH, LENGTH, generator=g) > 0.4, -100)
        batches.append({"input_ids": ids, "attention_mask": real.long(), "labels": labels})
    return batches


def _big_batch_step(family, batches):
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    big = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    model(**big).loss.backward()
    opt.step()
    return model


def _counted_window(family, batches, count):
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = aiak.optimize(model, opt, batches, count_items=count,
                                           strategy={"grad_accumulation": MICRO_BATCHES, "tune": False})
    steps = 0
    for batch in loader:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        steps += aiak.stepped(opt)
    assert steps == 1
    return model


def _max_diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_the_quickstart_documents_a_count_for_each_family():
    assert set(documented_counts()) == {"causal", "masked"}


@pytest.mark.parametrize("family", ["causal", "masked"])
def test_each_documented_count_gives_the_big_batchs_step(family):
    counts = documented_counts()
    batches = _batches(family)
    big = _big_batch_step(family, copy.deepcopy(batches))
    assert _max_diff(_counted_window(family, batches, counts[family]), big) < 1e-6
    other = counts["masked" if family == "causal" else "causal"]
    assert _max_diff(_counted_window(family, batches, other), big) > 1e-5  # the control: the other family's count
