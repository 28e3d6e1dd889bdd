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
        trainer = transformers.Trainer(model=TinyClassifier(), args=arguments, train_dataset=Samples(),
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
