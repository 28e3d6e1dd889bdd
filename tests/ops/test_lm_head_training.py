"""``fused_ops: [linear_cross_entropy]`` through ``aiak.optimize`` on a real Hugging Face causal LM: what it composes
with, each held to the same run without the knob.

Tolerances: fp32 runs agree to 1e-5 in every step's loss and 1e-5 in the weights after them (float sums in
another order; 1e-3 after 20 AdamW steps, which scales rounding in tiny gradients up to the learning rate); bf16 runs (O1, O2) to 2e-2 in the losses, the distance bf16's rounding puts between two
orders of the same sums over a few steps."""
import copy
import warnings

import pytest
import torch

import aiak
from tests.graphs import graph_breaks

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, BATCH = 211, 12, 2
FUSED = {"fused_ops": ["linear_cross_entropy"]}


def _model(tie=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                                      tie_word_embeddings=tie, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).train()


def _batches(n, seed=1):
    """Padded sequences of 2 to 12 tokens, -100 on the padding: each batch counts a different number of tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
        real = torch.arange(LENGTH)[None, :] < torch.randint(2, LENGTH + 1, (BATCH,), generator=g)[:, None]
        out.append({"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~real, -100)})
    return out


def _shard(model):
    """FSDP2 as a script applies it before the aiak line: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _train(strategy, batches, clip=None, tie=False, make_optimizer=None, prepare=None, **optimize_kwargs):
    model = _model(tie)
    if prepare is not None:
        model = prepare(model)
    optimizer = (make_optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-2)))(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = aiak.optimize(model, optimizer, batches, strategy={"tune": False, **strategy},
                                                 **optimize_kwargs)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        losses.append(float(loss))
        if clip is not None and aiak.stepped(optimizer) is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return model, losses


def _max_diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _log_probs(model, batch):
    model.eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), -1)


def test_twenty_steps_of_adamw_train_the_same_model_every_step():
    batches = _batches(4) * 5                                      # seen five times: the loss falls
    plain, plain_losses = _train({}, batches)
    fused, losses = _train(FUSED, batches)
    assert type(fused).__name__ == "FusedLlamaForCausalLM"
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    assert plain_losses[-1] < plain_losses[0] - 0.5                # it trained
    # AdamW divides each gradient by its own running size, so float-order differences in gradients near zero
    # reach the weights at up to the learning rate per step: 1.8e-4 measured after 20 steps at 1e-2 (0.1% of
    # how far the weights moved), to 1e-5 in every loss.
    assert _max_diff(fused, plain) < 1e-3
    held_out = _batches(1, seed=9)[0]
    torch.testing.assert_close(_log_probs(fused, held_out), _log_probs(plain, held_out), rtol=1e-3, atol=1e-3)


def test_a_window_of_counted_micro_batches_equals_the_big_batch_as_without_the_knob():
    batches = _batches(4)
    count = (lambda batch: (batch["labels"][:, 1:] != -100).sum())     # the quickstart's causal-LM count
    sgd = (lambda p: torch.optim.SGD(p, lr=1.0))
    big = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    reference, _ = _train({}, [big], make_optimizer=sgd)
    plain, _ = _train({"grad_accumulation": 4}, batches, make_optimizer=sgd, count_items=count)
    fused, _ = _train({**FUSED, "grad_accumulation": 4}, batches, make_optimizer=sgd, count_items=count)
    assert _max_diff(plain, reference) < 1e-6
    assert _max_diff(fused, reference) < 1e-6
    uncounted, _ = _train({**FUSED, "grad_accumulation": 4}, batches, make_optimizer=sgd)
    assert _max_diff(uncounted, reference) > 1e-5                    # the control: the mean of the means is off


def test_hugging_faces_num_items_in_batch_divides_the_fused_loss_as_the_unfused_one():
    # The Trainer passes a window's token count to every micro-batch's forward; Liger's head once ignored it and
    # reported losses off by the accumulation factor.
    batches = _batches(4)
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    for strategy in ({}, FUSED):
        model = _model()
        if strategy:
            aiak.ops.replace_lm_heads(model)
        losses = [model(**b, num_items_in_batch=torch.tensor(total)) .loss for b in batches]
        sum(losses).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if not strategy:
            reference_losses, reference_grads = [float(x) for x in losses], grads
    torch.testing.assert_close([float(x) for x in losses], reference_losses, rtol=1e-6, atol=0)
    for g, r in zip(grads, reference_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_o1_and_o2_train_as_without_the_knob(level):
    batches = _batches(8)
    precision = {"precision": {"level": level, "dtype": "bf16"}}
    plain, plain_losses = _train(precision, batches)
    fused, losses = _train({**precision, **FUSED}, batches)
    torch.testing.assert_close(losses, plain_losses, rtol=2e-2, atol=2e-2)
    assert all(p.dtype == torch.float32 for p in fused.parameters())


def test_clipping_and_tied_embeddings_train_as_without_the_knob():
    batches = _batches(6)
    plain, plain_losses = _train({}, batches, clip=0.5, tie=True)
    fused, losses = _train(FUSED, batches, clip=0.5, tie=True)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    assert _max_diff(fused, plain) < 1e-5


def _checkpointed(model):
    """Hugging Face's activation checkpointing, as a script turns it on for a large vocabulary (the Trainer's
    ``gradient_checkpointing=True``): each decoder layer recomputed in the backward."""
    if hasattr(model, "activation_checkpointing_enable"):     # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_hugging_faces_activation_checkpointing_trains_as_without_the_knob():
    batches = _batches(6)
    plain, plain_losses = _train({}, batches, prepare=_checkpointed)
    fused, losses = _train(FUSED, batches, prepare=_checkpointed)
    assert type(fused).__name__ == "FusedLlamaForCausalLM" and fused.model.gradient_checkpointing
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    assert _max_diff(fused, plain) < 1e-3     # AdamW's scaling of float-order differences, as in twenty steps
    unchecked, unchecked_losses = _train(FUSED, batches)    # recomputing the layers changes no number of the run
    assert losses == unchecked_losses and _max_diff(fused, unchecked) == 0.0


def test_the_summary_says_what_was_fused():
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    strategy={"tune": False, **FUSED})
    line = aiak.last_decision().effect("fused_ops")
    assert "linear_cross_entropy" in line and "1 module" in line, line


def test_compiled_with_ignored_tokens_it_computes_the_eager_loss_and_gradients_with_no_more_graph_breaks():
    # Liger's head once returned a silently wrong loss under torch.compile with ignore_index.
    batch = _batches(1)[0]
    plain = _model()
    fused = copy.deepcopy(plain)
    aiak.ops.replace_lm_heads(fused)
    eager = plain(**batch).loss
    eager.backward()
    fused(**batch)                                                    # the first call's check, eagerly
    compiled = torch.compile(fused)
    loss = compiled(**batch).loss
    fused.zero_grad(set_to_none=True)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * float(q.grad.abs().max()), msg=name)

    def step(model, ids, mask, labels):
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    args = (batch["input_ids"], batch["attention_mask"], batch["labels"])
    plain_breaks = graph_breaks(step, plain, *args)
    fused_breaks = graph_breaks(step, fused, *args)
    # None of aiak's own (there were five: a nonzero() in the slices, the output's class swapped); one run on two
    # workers once saw one more break than plain's outside aiak's code, which later runs did not reproduce.
    assert not [b for b in fused_breaks if "/aiak/" in b], fused_breaks
    assert len(fused_breaks) <= len(plain_breaks) + 1, (fused_breaks, plain_breaks)


def _ranks_train(rank, world):
    """On each rank its own batches, two micro-batches a window counted by tokens, under DDP, aiak's FSDP2 and
    the script's FSDP2 (``fully_shard`` before the aiak line): the weights after three windows with the knob and
    without, as full tensors. Then, on the script-sharded fused model, the logits read in training: before the
    backward (the root's gathered weight is still there) and after the backward and FSDP2's reshard (freed: the
    clear error)."""
    batches = _batches(6, seed=10 + rank)
    count = (lambda batch: (batch["labels"][:, 1:] != -100).sum())
    out = {}
    for engine in ("ddp", "fsdp2", "script"):
        for fused in (False, True):
            strategy = {"grad_accumulation": 2, **(FUSED if fused else {})}
            if engine != "script":
                strategy["comm"] = {"engine": engine}
            model, losses = _train(strategy, batches, count_items=count,
                                   prepare=_shard if engine == "script" else None)
            out[engine, fused] = ([p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                                   for p in model.parameters()], losses)
            if engine == "script":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")      # the one warning that the logits were read
                    output = model(**batches[0])
                    logits = output.logits.detach().clone()
                    output.loss.backward()
                    output = model(**batches[0])
                    output.loss.backward()
                    try:                                 # the window closed: FSDP2 resharded the root
                        output.logits
                        error = None
                    except RuntimeError as e:
                        error = str(e)
                model.zero_grad()
                out["logits", fused] = (logits, error)
    return out


@pytest.mark.slow
def test_ddp_aiaks_fsdp2_and_the_scripts_fsdp2_on_two_ranks_train_as_without_the_knob():
    from tests.ranks import spawn_ranks

    results = spawn_ranks(_ranks_train, world=2, timeout=300)
    for engine in ("ddp", "fsdp2", "script"):
        plain, plain_losses = results[0][engine, False]
        fused, losses = results[0][engine, True]
        torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5, msg=engine)
        assert max(float((a - b).abs().max()) for a, b in zip(fused, plain)) < 1e-3, engine
        other_rank, _ = results[1][engine, True]
        assert all(torch.equal(a, b) for a, b in zip(fused, other_rank)), engine    # the ranks agree
    ddp, _ = results[0]["ddp", True]
    assert max(float((a - b).abs().max()) for a, b in zip(ddp, results[0]["fsdp2", True][0])) < 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(ddp, results[0]["script", True][0])) < 1e-3
    (fused_logits, error), (plain_logits, _) = results[0]["logits", True], results[0]["logits", False]
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert error is not None and "gathered weight is already freed" in error, error
