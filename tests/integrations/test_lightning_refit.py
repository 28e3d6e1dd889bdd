"""``AiakCallback`` when Lightning asks ``configure_optimizers`` again (a second ``trainer.fit``, or
``Tuner.lr_find`` then ``fit``), and a LightningModule with two optimizers. Each once raised "already passed
through aiak.optimize()"."""
import pytest
import torch
from torch import nn

import aiak

pl = pytest.importorskip("pytorch_lightning")

from aiak.integrations.lightning import AiakCallback  # noqa: E402
from tests.integrations.test_lightning import Classifier, _loader  # noqa: E402

ACCUMULATE_2 = {"grad_accumulation": 2}


def _trainer(callbacks, **kw):
    return pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


def _fit_twice(callbacks):
    module = Classifier()
    for _ in range(2):
        _trainer(callbacks).fit(module, train_dataloaders=_loader())
    return module


def test_a_second_fit_with_the_callback_trains_like_lightnings_own_accumulation():
    """Two fits through AiakCallback(grad_accumulation 2) equal two fits with accumulate_grad_batches=2."""
    with_aiak = _fit_twice([AiakCallback(ACCUMULATE_2)])
    module = Classifier()
    for _ in range(2):
        _trainer([], accumulate_grad_batches=2).fit(module, train_dataloaders=_loader())
    for p, q in zip(with_aiak.parameters(), module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class WithLearningRate(Classifier):
    def __init__(self):
        super().__init__()
        self.lr = 0.5

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def test_lr_find_then_fit_with_the_callback():
    from pytorch_lightning.tuner import Tuner

    module = WithLearningRate()
    trainer = _trainer([AiakCallback(ACCUMULATE_2)], max_steps=4)
    Tuner(trainer).lr_find(module, train_dataloaders=_loader(), num_training=4, early_stop_threshold=None)
    trainer.fit(module, train_dataloaders=_loader())
    assert aiak.last_decision().strategy["grad_accumulation"] == 2
    assert module.trainer.optimizers[0]._aiak_steps.accumulation == 2


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with one optimizer per submodule, each passed through aiak.optimize as the docs say."""

    def __init__(self, strategy=None):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Sequential(nn.Linear(12, 32), nn.Tanh()), nn.Linear(32, 3)
        self.strategy = strategy
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.body(x)), y)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        body = torch.optim.SGD(self.body.parameters(), lr=0.5, momentum=0.9)
        head = torch.optim.Adam(self.head.parameters(), lr=0.01)
        if self.strategy is not None:
            _, body, _ = aiak.optimize(self, body, strategy=self.strategy)
            _, head, _ = aiak.optimize(self, head, strategy=self.strategy)
        return [body, head]


def test_two_optimizers_of_one_module_each_through_optimize():
    """With grad_accumulation 2 each, the run equals the same module stepping both optimizers every other batch
    on the loss halved (manual accumulation, no aiak)."""
    with_aiak = TwoOptimizers(ACCUMULATE_2)
    _trainer([]).fit(with_aiak, train_dataloaders=_loader())

    class ByHand(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            x, y = batch
            self.manual_backward(nn.functional.cross_entropy(self.head(self.body(x)), y) / 2)
            if batch_idx % 2 == 1:
                for opt in self.optimizers():
                    opt.step()
                    opt.zero_grad()

    by_hand = ByHand()
    _trainer([]).fit(by_hand, train_dataloaders=_loader())
    for p, q in zip(with_aiak.parameters(), by_hand.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_callback_passes_each_of_several_optimizers_through_optimize():
    """configure_optimizers returning ([optimizers], [schedulers]) under the callback: each optimizer gets aiak's
    stepping and its own scheduler back, which advances once per real step."""

    class WithSchedulers(TwoOptimizers):
        def configure_optimizers(self):
            body, head = super().configure_optimizers()
            return [body, head], [torch.optim.lr_scheduler.StepLR(head, step_size=1, gamma=0.5)]

    module = WithSchedulers()
    _trainer([AiakCallback(ACCUMULATE_2)], max_steps=0).fit(module, train_dataloaders=_loader())
    body, head = module.trainer.optimizers
    assert body._aiak_steps.accumulation == head._aiak_steps.accumulation == 2
    (config,) = module.trainer.lr_scheduler_configs
    assert config.scheduler.optimizer is head
