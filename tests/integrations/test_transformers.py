"""aiak inside Hugging Face's ``Trainer`` with its default ``TrainingArguments`` (issue 14): CPU, a tiny model.

Defaults matter here: ``average_tokens_across_devices=True`` makes the Trainer do ``loss *= ...`` on the
model's output, ``max_grad_norm=1.0`` clips through ``accelerator.clip_grad_norm_``, and the Trainer calls
``model.zero_grad()`` after every step. The scheduler goes through ``aiak.optimize(scheduler=...)`` so that it
advances once per real step (the recipe of :mod:`aiak.integrations.transformers`).
"""
import warnings

import pytest
import torch
from torch import nn

import aiak

transformers = pytest.importorskip("transformers")

from tests.integrations.conftest import aiak_warnings, max_abs_diff, tensors  # noqa: E402


class Samples(torch.utils.data.Dataset):
    def __init__(self, n=32):
        self.x, self.y = tensors(n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class TinyClassifier(nn.Module):
    """Takes ``num_items_in_batch`` like Hugging Face models (so the Trainer counts tokens and scales the loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        return {"loss": loss / (num_items_in_batch if num_items_in_batch is not None else labels.numel()),
                "logits": logits}


class LoudClassifier(TinyClassifier):
    """A loss a thousand times larger: fp16's first backward passes overflow at the initial loss scale (2**16), so
    the scale moves within a few steps."""

    def forward(self, x, labels=None, num_items_in_batch=None, **kwargs):
        out = super().forward(x, labels, num_items_in_batch, **kwargs)
        return {"loss": 1e3 * out["loss"], "logits": out["logits"]}


def _train(tmp_path, batch, strategy=None, real_steps=4, **args):
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, real_steps)
    if strategy is not None:
        model, opt, _, sched = aiak.optimize(model, opt, strategy=strategy, scheduler=sched)
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / f"run{batch}"), report_to=[], use_cpu=True,
                                               per_device_train_batch_size=batch, num_train_epochs=1,
                                               logging_steps=1, save_strategy="no", disable_tqdm=True, **args)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Samples(), optimizers=(opt, sched))
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return model, norms


def test_default_arguments_and_grad_accumulation_equal_a_plain_bigger_batch(tmp_path):
    """aiak accumulating 2 batches of 4 equals the Trainer on batches of 8 (1e-6), with its default clipping at
    1.0 active (some logged norm is above 1) and the last of each window's norms equal to the big batch's."""
    accumulated, acc_norms = _train(tmp_path, 4, {"grad_accumulation": 2})
    big, big_norms = _train(tmp_path, 8)
    assert max_abs_diff(accumulated, big) < 1e-6
    assert max(big_norms) > 1.0
    assert acc_norms[1::2] == pytest.approx(big_norms, rel=1e-5)


def test_stacked_accumulation_warns_once_and_the_trainers_wins(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stacked, _ = _train(tmp_path, 4, {"grad_accumulation": 2}, gradient_accumulation_steps=2)
    said = aiak_warnings(record)
    assert len(said) == 1 and "gradient_accumulation_steps" in said[0], said
    big, _ = _train(tmp_path, 8)
    assert max_abs_diff(stacked, big) < 1e-6  # 2 batches per step, as asked of the Trainer (not 4)


@pytest.mark.filterwarnings("ignore:.*fp16.*:UserWarning")  # fp16 is emulated on a CPU
def test_fp16_loss_scaling_with_max_grad_norm_clips_the_true_gradient(tmp_path):
    """O2 fp16 with a loss scale of 1024: the Trainer's logged (and clipped-to) norms are the true ones, within 1e-3
    of fp32 training's (they were about 16000 when the clip saw scaled gradients), and the weights stay within
    fp16's resolution (2e-3) of fp32 training."""
    half, half_norms = _train(tmp_path, 8, {"precision": {"level": "O2", "dtype": "fp16", "loss_scale": 1024}})
    fp32, fp32_norms = _train(tmp_path, 8)
    assert half.net[0].weight.dtype == torch.float32  # the parameters stay fp32; the forward computes in fp16
    assert half_norms == pytest.approx(fp32_norms, rel=1e-3)
    assert max(fp32_norms) > 1.0  # max_grad_norm=1.0 really clipped
    assert 0 < max_abs_diff(half, fp32) < 2e-3  # fp16 really computed, within its resolution


def test_the_callback_with_grad_accumulation_equals_a_plain_bigger_batch(tmp_path):
    """AiakTrainerCallback on the Trainer's own AdamW (constant schedule: a Trainer-built schedule counts Trainer
    steps): accumulating 2 batches of 4 equals batches of 8 without aiak (1e-6)."""
    from aiak.integrations.transformers import AiakTrainerCallback

    def train(batch, callbacks):
        model = TinyClassifier()
        arguments = transformers.TrainingArguments(output_dir=str(tmp_path / f"cb{batch}"), report_to=[],
                                                   use_cpu=True, per_device_train_batch_size=batch,
                                                   num_train_epochs=1, save_strategy="no", disable_tqdm=True,
                                                   learning_rate=1e-2, lr_scheduler_type="constant")
        transformers.Trainer(model=model, args=arguments, train_dataset=Samples(), callbacks=callbacks).train()
        return model

    with_callback = train(4, [AiakTrainerCallback({"grad_accumulation": 2})])
    plain = train(8, [])
    assert max_abs_diff(with_callback, plain) < 1e-6
    assert max_abs_diff(TinyClassifier(), plain) > 1e-3  # it trained


def test_resuming_from_a_checkpoint_with_the_callback_continues_bit_for_bit(tmp_path):
    """``trainer.train(resume_from_checkpoint=...)`` under O2 fp16 with accumulation: the Trainer loads the
    optimizer's state before the callback applies aiak, so aiak's part of it (the loss scale, the steps the
    scheduler counted) once went missing and the resumed run restarted at the initial scale. Now the resumed
    run's weights and loss scaler equal the uninterrupted run's exactly."""
    from aiak.integrations.transformers import AiakTrainerCallback
    from aiak.step.controller import controller_of

    strategy = {"precision": {"level": "O2", "dtype": "fp16"}, "grad_accumulation": 2}

    def train(out, resume=None):
        arguments = transformers.TrainingArguments(output_dir=str(tmp_path / out), report_to=[], use_cpu=True,
                                                   per_device_train_batch_size=4, max_steps=8, save_steps=4,
                                                   disable_tqdm=True, learning_rate=1e-2, seed=0)
        trainer = transformers.Trainer(model=LoudClassifier(), args=arguments, train_dataset=Samples(),
                                       callbacks=[AiakTrainerCallback(strategy)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(resume_from_checkpoint=resume)
        return trainer.model, controller_of(trainer.optimizer).scaler.state_dict()

    whole, whole_scaler = train("whole")
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    resumed, resumed_scaler = train("resumed", resume=str(checkpoint))
    assert max_abs_diff(resumed, whole) == 0
    assert resumed_scaler == whole_scaler
    # what makes the test able to fail: by the checkpoint the scale had left its initial value
    import json
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["AiakTrainerCallback"]
    assert saved["attributes"]["checkpoint_extras"]["loss_scaler"]["skipped_steps"] >= 1


class _Sequences(torch.utils.data.Dataset):
    """20 token sequences of 2 to 15 tokens: a causal LM's micro-batches hold from a few to dozens of real tokens."""

    def __init__(self, n=20):
        g = torch.Generator().manual_seed(3)
        self.rows = [torch.randint(0, 32, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g)
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def _pad(rows):
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _causal_lm_trainer(tmp_path, name, accumulation, callbacks, epochs=2):
    config = transformers.GPT2Config(vocab_size=32, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / name), report_to=[], use_cpu=True,
                                               per_device_train_batch_size=2, num_train_epochs=epochs,
                                               gradient_accumulation_steps=accumulation, optim="sgd",
                                               learning_rate=0.5, lr_scheduler_type="constant", save_strategy="no",
                                               disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_Sequences(), data_collator=_pad,
                                   callbacks=callbacks)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, aiak_warnings(record)


def test_a_causal_lm_on_variable_lengths_accumulated_by_aiak_equals_the_trainers_own_accumulation(tmp_path):
    """GPT-2 (random weights) on sequences of 2-15 tokens, 10 batches per epoch, two epochs. The Trainer's own
    gradient_accumulation_steps=4 divides each window by its tokens and closes it at the epoch's end (windows 4, 4,
    2). aiak's grad_accumulation: 4 under the callback (Trainer steps of one batch) weighs each micro-batch by the
    tokens the Trainer counted for it and closes at the same batches: equal to 1e-6. Uncounted (the mean of the
    micro-batches' means) it is not; with both accumulations the Trainer's wins and nothing is weighed twice."""
    from aiak.integrations.transformers import AiakTrainerCallback

    trainers, _ = _causal_lm_trainer(tmp_path, "trainer", 4, [])
    assert trainers.model_accepts_loss_kwargs  # the Trainer divides by the window's tokens itself
    aiaks, said = _causal_lm_trainer(tmp_path, "aiak", 1, [AiakTrainerCallback({"grad_accumulation": 4,
                                                                                 "tune": False})])
    assert not said, said  # the callback closes the windows at the epoch's end: nothing to warn about
    assert max_abs_diff(aiaks.model, trainers.model) < 1e-6
    both, said = _causal_lm_trainer(tmp_path, "both", 4, [AiakTrainerCallback({"grad_accumulation": 4,
                                                                               "tune": False})])
    assert len(said) == 1 and "gradient_accumulation_steps" in said[0], said
    assert max_abs_diff(both.model, trainers.model) < 1e-6

    class NoCount(AiakTrainerCallback):  # the control: the same windows, each micro-batch's mean weighed alike
        def _count_items(self, module, args, kwargs):
            pass

    uncounted, _ = _causal_lm_trainer(tmp_path, "uncounted", 1, [NoCount({"grad_accumulation": 4, "tune": False})])
    assert max_abs_diff(uncounted.model, trainers.model) > 1e-4
