"""aiak.ops.replace_lm_heads on real Hugging Face causal and masked LMs (random weights, tiny configs, nothing
downloaded).

Each family's fused model is held to the unfused one: the loss within 1e-6 relative and every parameter's
gradient within 1e-5 of the largest (fp32), with ignored labels and an odd sequence length. Then what scripts do
around a model: evaluation, reading the logits, copies, checkpoints, LoRA, counted items.
"""
import copy
import io
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aiak.ops import replace_lm_heads, restore_lm_heads                    # noqa: E402
from aiak.ops.lm_head import FusedCausalLM, lm_head_problem                 # noqa: E402
from tests.graphs import graph_breaks                                       # noqa: E402

VOCAB = 503


def _config(family, **extra):
    if family == "GPT2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family.startswith("Gemma"):
        sizes["head_dim"] = 8
    return getattr(transformers, f"{family}Config")(**sizes, **extra)


# family, config overrides: each family's own logit transform set away from its identity default
FAMILIES = [
    ("GPT2", {}),
    ("Llama", {}),
    ("Llama", {"tie_word_embeddings": True}),
    ("Mistral", {}),
    ("Qwen2", {}),
    ("Gemma", {}),
    ("Gemma2", {"final_logit_softcapping": 2.0}),
    ("Phi3", {}),
    ("Cohere", {"logit_scale": 0.3}),
    ("Granite", {"logits_scaling": 4.0}),
]


def _model(family, seed=0, **extra):
    torch.manual_seed(seed)
    cls = transformers.GPT2LMHeadModel if family == "GPT2" else getattr(transformers, f"{family}ForCausalLM")
    return cls(_config(family, **extra)).train()


def _batch(batch=2, length=17, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100                                   # a prompt the loss leaves out
    return ids, labels


def _loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_loss_and_grads(loss, grads, fused_loss, fused_grads):
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    assert fused_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)


def _assert_same_training(plain, fused, **kwargs):
    ids, labels = _batch()
    _assert_same_loss_and_grads(*_loss_and_grads(plain, ids, labels, **kwargs),
                                *_loss_and_grads(fused, ids, labels, **kwargs))


def _fused_copy(plain):
    fused = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # a model left unfused would warn
        assert replace_lm_heads(fused) == 1
    return fused


def _family_id(value):
    return value if isinstance(value, str) else ",".join(f"{k}={x}" for k, x in value.items())


@pytest.mark.parametrize("family, extra", FAMILIES, ids=_family_id)
def test_each_family_trains_exactly_as_unfused(family, extra):
    plain = _model(family, **extra)
    fused = _fused_copy(plain)
    assert isinstance(fused, FusedCausalLM) and isinstance(fused, type(plain))
    _assert_same_training(plain, fused)


MASKED = [("ModernBert", {}), ("ModernBert", {"sparse_prediction": True}), ("EuroBert", {})]


def _masked_model(family, **extra):
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "ModernBert":
        sizes.update(cls_token_id=1, sep_token_id=2, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
    else:
        sizes.update(num_key_value_heads=2, mask_token_id=3)
    config = getattr(transformers, f"{family}Config")(**sizes, **extra)
    return getattr(transformers, f"{family}ForMaskedLM")(config).train()


def _masked_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (2, 17), generator=g)
    labels = torch.full_like(ids, -100)
    scored = torch.rand(ids.shape, generator=g) < 0.3
    labels[scored] = ids[scored]
    return ids, labels


@pytest.mark.parametrize("family, extra", MASKED, ids=_family_id)
def test_masked_lms_train_exactly_as_unfused_and_their_head_runs_over_the_scored_tokens_alone(family, extra):
    plain = _masked_model(family, **extra)
    fused = _fused_copy(plain)
    ids, labels = _masked_batch()
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        fused_training = _loss_and_grads(fused, ids, labels)
    _assert_same_loss_and_grads(*_loss_and_grads(plain, ids, labels), *fused_training)
    scored = int((labels != -100).sum())
    assert (scored, 32) in shapes                          # the head's gradient: the scored tokens' alone
    assert not any(len(s) >= 2 and s[-1] == VOCAB for s in shapes)     # no logits kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # the one warning that the logits were read
        made = fused(input_ids=ids, labels=labels).logits
    expected = plain(input_ids=ids, labels=labels).logits  # ModernBERT's sparse prediction: [scored, vocab]
    assert made.shape == expected.shape
    torch.testing.assert_close(made, expected, rtol=1e-5, atol=1e-5)


def test_the_logits_are_never_made_in_a_fused_training_step():
    fused = _model("Llama")
    replace_lm_heads(fused)
    ids, labels = _batch()
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        fused(input_ids=ids, labels=labels).loss.backward()
    assert shapes and not any(s[-1:] == (VOCAB,) and len(s) >= 2 and s[-2] in (17, 34) for s in shapes), shapes
    plain = _model("Llama")
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        plain(input_ids=ids, labels=labels).loss.backward()
    assert any(s[-1:] == (VOCAB,) for s in shapes)         # the check can fail: plain keeps them


def test_num_items_in_batch_ignore_index_and_shift_labels_are_what_the_unfused_loss_does():
    plain = _model("Qwen2")
    fused = copy.deepcopy(plain)
    replace_lm_heads(fused)
    _assert_same_training(plain, fused, num_items_in_batch=torch.tensor(50))
    ids, labels = _batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shifted[1, 3] = 7                                      # something the default shift would not make
    _assert_same_training(plain, fused, shift_labels=shifted)
    labels7 = labels.clone()
    labels7[labels7 == -100] = 7
    labels7[1, :4] = 7
    for model in (plain, fused):
        model.zero_grad(set_to_none=True)
    a = plain(input_ids=ids, labels=labels7, ignore_index=7).loss
    b = fused(input_ids=ids, labels=labels7, ignore_index=7).loss
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


def test_evaluation_no_grad_and_no_labels_run_the_original_forward_with_logits():
    plain = _model("GPT2")
    fused = copy.deepcopy(plain)
    replace_lm_heads(fused)
    ids, labels = _batch()
    fused.eval()
    plain.eval()
    out, ref = fused(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    fused.train()
    plain.train()
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids, labels=labels).logits,
                                   plain(input_ids=ids, labels=labels).logits)
    torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert fused(input_ids=ids).loss is None


def test_logits_read_in_training_are_made_then_with_one_warning_and_take_gradients(said, warnings_said_again):
    plain = _model("Gemma2", final_logit_softcapping=2.0)
    fused = copy.deepcopy(plain)
    replace_lm_heads(fused)
    ids, labels = _batch()
    out, ref = fused(input_ids=ids, labels=labels), plain(input_ids=ids, labels=labels)
    assert out[0] is out.loss and out["loss"] is out.loss   # the loss first, as unfused
    with said:
        logits = out.logits
        assert out.logits is logits
    assert said.text.count("read outputs.logits in training, so they were computed after all") == 1, said.text
    torch.testing.assert_close(logits, ref.logits)
    assert out["logits"] is logits and out.logits is logits   # made once
    (out.loss + logits.square().mean()).backward()          # an extra loss on the logits
    (ref.loss + ref.logits.square().mean()).backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * float(q.grad.abs().max()), msg=name)


def test_return_dict_false_runs_unfused_and_returns_the_tuple():
    plain = _model("Mistral")
    fused = copy.deepcopy(plain)
    replace_lm_heads(fused)
    ids, labels = _batch()
    loss, logits = fused(input_ids=ids, labels=labels, return_dict=False)[:2]
    ref_loss, ref_logits = plain(input_ids=ids, labels=labels, return_dict=False)[:2]
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)


def test_a_forward_that_transforms_logits_another_way_is_found_on_the_first_call_and_left_unfused(said):
    # Llama's forward ignores a final_logit_softcapping in its config; aiak reads the config, so the first call's
    # check must see that the forward did not soft-cap, and the model must train unfused from then on.
    plain = _model("Llama")
    plain.config.final_logit_softcapping = 2.0
    fused = copy.deepcopy(plain)
    assert replace_lm_heads(fused) == 1
    ids, labels = _batch()
    with said:
        first = fused(input_ids=ids, labels=labels)
    assert ("LlamaForCausalLM runs unfused: its forward transforms the logits after the head in a way aiak does not "
            "reproduce") in said.text
    torch.testing.assert_close(first.loss, plain(input_ids=ids, labels=labels).loss)
    assert first.logits.shape[-1] == VOCAB                  # unfused: real logits
    _assert_same_training(plain, fused)


def test_state_dict_tied_weights_copies_and_whole_model_pickles_are_untouched():
    plain = _model("Llama", tie_word_embeddings=True)
    fused = copy.deepcopy(plain)
    replace_lm_heads(fused)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    reference = plain.state_dict()
    state = fused.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    ema = copy.deepcopy(fused)                              # timm's ModelEmaV3, swa_utils.AveragedModel copy so
    assert isinstance(ema, FusedCausalLM) and ema.__dict__["_aiak_fused_head"].head is ema.lm_head
    _assert_same_training(plain, ema)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _assert_same_training(plain, loaded)
    assert restore_lm_heads(fused) == 1 and type(fused) is type(plain) and type(fused.lm_head) is torch.nn.Linear
    assert "_aiak_fused_head" not in fused.__dict__
    _assert_same_training(plain, fused)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lora_wrapped_head_gets_the_unfused_gradients_on_its_adapters(dropout):
    peft = pytest.importorskip("peft")
    base = _model("Llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["q_proj", "lm_head"])
    plain = peft.get_peft_model(base, config)
    fused = copy.deepcopy(plain)
    assert replace_lm_heads(fused) == 1
    assert isinstance(fused.base_model.model, FusedCausalLM)
    for model in (plain, fused):                            # LoRA B starts at zero: give the adapters a value
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    ids, labels = _batch()
    torch.manual_seed(5)
    loss, grads = _loss_and_grads(plain, ids, labels)
    torch.manual_seed(5)                                    # the same dropout masks, drawn at the same point
    fused_loss, fused_grads = _loss_and_grads(fused, ids, labels)
    assert any("lm_head.lora_A" in n for n in grads) and not any("lm_head.base_layer" in n for n in grads)
    assert fused_grads.keys() == grads.keys()
    torch.testing.assert_close(fused_loss, loss, rtol=1e-6, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)


def test_models_that_are_not_causal_lms_are_left_alone_saying_why(said):
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=4, intermediate_size=64))
    assert "computes its loss without self.loss_function" in lm_head_problem(bert)
    with said:
        assert replace_lm_heads(bert) == 0
    assert ("left 1 language model(s) unfused: <root> (BertForMaskedLM): its forward computes its loss without "
            "self.loss_function") in said.text
    classifier = transformers.GPT2ForSequenceClassification(_config("GPT2", num_labels=3))
    assert replace_lm_heads(classifier) == 0               # no output embedding: not a language model, no warning
    assert replace_lm_heads(torch.nn.Linear(3, 3)) == 0


def test_a_fused_model_fuses_once():
    fused = _model("GPT2")
    assert replace_lm_heads(fused) == 1
    assert replace_lm_heads(fused) == 0 and type(type(fused).__mro__[1]) is type


def test_code_walking_the_outputs_fields_does_not_make_the_logits(said, warnings_said_again):
    # FSDP2's post-forward walks an output's dataclass fields for tensors that need gradients: reading a lazy
    # logits field there made them after the sharded weight was freed (a crash on 2 ranks under comm.engine fsdp2).
    import dataclasses

    walker = pytest.importorskip("torch.distributed.fsdp._common_utils", reason="FSDP2's output walker (torch 2.6+)")
    collect_grad_tensors = walker.collect_grad_tensors

    fused = _model("Llama")
    replace_lm_heads(fused)
    ids, labels = _batch()
    with said:
        out = fused(input_ids=ids, labels=labels)
        assert "logits" not in [f.name for f in dataclasses.fields(out)] and "logits" not in out.keys()
        assert [t is out.loss for t in collect_grad_tensors(out)] == [True]
        assert out.to_tuple()[0] is out.loss
    assert "read outputs.logits" not in said.text and out.__dict__.get("_aiak_logits") is None


def test_a_compiled_masked_lm_scores_every_token_and_trains_as_unfused():
    # Under torch.compile the scored tokens are not picked out (a host sync): every token runs through the fused
    # head, the ignored ones adding nothing, and the result is the unfused model's.
    plain = _masked_model("EuroBert")
    compiled = torch.compile(_fused_copy(plain))
    ids, labels = _masked_batch()
    _loss_and_grads(compiled, ids, labels)
    fused_loss, fused_grads = _loss_and_grads(compiled, ids, labels)
    fused_grads = {name.removeprefix("_orig_mod."): g for name, g in fused_grads.items()}
    _assert_same_loss_and_grads(*_loss_and_grads(plain, ids, labels), fused_loss, fused_grads)

    def step(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    plain_breaks = graph_breaks(step, plain, ids, labels)
    fused_breaks = graph_breaks(step, compiled._orig_mod, ids, labels)
    assert not [b for b in fused_breaks if "/aiak/" in b], fused_breaks      # none in aiak's code
    assert len(fused_breaks) <= len(plain_breaks), (fused_breaks, plain_breaks)


def _tensor_parallel_head(rank, world):
    """On one gloo rank: the head sharded over the vocabulary by tensor parallelism (``ColwiseParallel``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plain = _model("Llama")
    fused = copy.deepcopy(plain)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(fused, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    replace_lm_heads(fused)
    ids, labels = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = fused(input_ids=ids, labels=labels).loss
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return float(loss), float(plain(input_ids=ids, labels=labels).loss), [str(w.message) for w in caught]


def test_a_tensor_parallel_head_runs_unfused_saying_why():
    from tests.ranks import spawn_ranks

    [(loss, plain_loss, said)] = spawn_ranks(_tensor_parallel_head, world=1, timeout=120)
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert any("runs unfused: its head's weight is a DTensor (tensor parallelism)" in w for w in said), said
