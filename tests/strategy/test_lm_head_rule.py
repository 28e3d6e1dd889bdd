"""``auto`` and the language-model head: the probe of one batch's logits, and the profile that fuses them when large.

Real GPT-2 and BERT models from transformers (random weights, narrow), and real DataLoaders of token sequences."""
import pytest
import torch

import aiak
from aiak.api import explain
from aiak.strategy.probes import lm_head_logits_bytes

transformers = pytest.importorskip("transformers")

VOCAB = 50257


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                                                                n_positions=1024))


def _loader(batch_size, length, samples=8):
    data = [{"input_ids": torch.zeros(length - (i % 3), dtype=torch.long)} for i in range(samples)]
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def test_the_probe_is_tokens_of_the_longest_sample_times_batch_size_times_vocabulary_in_fp32():
    assert lm_head_logits_bytes(_gpt2(), _loader(4, 1024)) == 4 * 1024 * VOCAB * 4
    assert lm_head_logits_bytes(_gpt2(), None) == 0                       # no batches to measure
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=32))
    assert lm_head_logits_bytes(bert, _loader(4, 512)) == 0               # not a causal LM aiak fuses
    fused = _gpt2()
    aiak.ops.replace_lm_heads(fused)
    assert lm_head_logits_bytes(fused, _loader(4, 1024)) == 4 * 1024 * VOCAB * 4


def test_auto_fuses_the_head_when_a_batchs_logits_are_large_and_says_why():
    model = _gpt2()
    record = explain(model, torch.optim.AdamW(model.parameters()), _loader(4, 1024))
    knob = record.knobs["fused_ops"]
    assert "linear_cross_entropy" in str(knob["value"]), knob
    assert f"lm_head_logits_bytes >=2.56e8 (found {4 * 1024 * VOCAB * 4:,})" in knob["reason"], knob
    small = explain(model, torch.optim.AdamW(model.parameters()), _loader(1, 256))
    assert "linear_cross_entropy" not in str(small.knobs["fused_ops"]["value"])
    assert "lm_head_logits_bytes >=2.56e8 (found 51,463,168)" in small.not_matched["lm_head"]
