"""aiak inside PyTorch Lightning's ``Trainer.fit`` (issue 14): CPU, random weights, a tiny MLP.

Each run is compared with Lightning without aiak doing the same thing (its own accumulation, or aiak in a plain
loop for O2, whose half-precision compute copies of the fp32 parameters Lightning has no switch for).
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import aiak

pl = pytest.importorskip("pytorch_lightning")

from tests.integrations.conftest import aiak_warnings, max_abs_diff, tensors  # noqa: E402

BATCH = 8
O2_BF16 = {"precision": {"level": "O2", "dtype": "bf16"}}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _loader(batch=BATCH):
    x, y = tensors()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))


class Classifier(pl.LightningModule):
    """``strategy``: given to ``aiak.optimize`` inside ``configure_optimizers`` (None: no aiak). ``manual``: manual
    optimization that steps every ``manual_every`` batches, dividing the loss by it (accumulation by hand)."""

    def __init__(self, strategy=None, manual=False, manual_every=1):
        super().__init__()
        self.net = _net()
        self.strategy, self.manual_every = strategy, manual_every
        self.automatic_optimization = not manual

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            self.manual_backward(loss / self.manual_every)
            if (batch_idx + 1) % self.manual_every == 0:
                opt.step()
                opt.zero_grad()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        if self.strategy is not None:
            _, opt, _ = aiak.optimize(self, opt, strategy=self.strategy)
        return opt


def _compute_dtype(module):
    """The dtype ``module.net[0]`` computes with: its weight as the layer sees it inside a forward (under O2 a half
    copy of the fp32 parameter, which is what the module holds outside it)."""
    seen = []
    handle = module.net[0].register_forward_hook(lambda m, args, out: seen.append(m.weight.dtype))
    with torch.no_grad():
        module(tensors(2)[0])
    handle.remove()
    return seen[0]


def _fit(module, **trainer_kw):
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    trainer.fit(module, train_dataloaders=_loader())
    return module


def _plain_loop_with_aiak(strategy, clip):
    """The same training as Lightning's automatic optimization, in a plain loop (zero_grad, forward, backward,
    clip, step), aiak applied the same way."""
    net = _net()
    net, opt, _ = aiak.optimize(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9), strategy=strategy)
    for x, y in _loader():
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return net


def test_o2_bf16_with_gradient_clip_val_equals_the_plain_loop():
    """Lightning steps with step(closure) and clips inside the closure: bit-identical weights to aiak O2 bf16 in a
    plain loop, and within bf16's resolution (2e-2) of fp32 Lightning (which it would not be if O2 did nothing
    or clipping saw other gradients)."""
    fitted = _fit(Classifier(O2_BF16), gradient_clip_val=0.5)
    plain = _plain_loop_with_aiak(O2_BF16, clip=0.5)
    assert fitted.net[0].weight.dtype == torch.float32 and _compute_dtype(fitted) == torch.bfloat16
    for a, b in zip(fitted.state_dict().values(), plain.state_dict().values()):  # the fp32 parameters
        assert torch.equal(a, b)
    fp32 = _fit(Classifier(), gradient_clip_val=0.5)
    assert 1e-4 < max_abs_diff(fitted, fp32) < 2e-2


def test_grad_accumulation_with_gradient_clip_val_equals_lightnings_accumulation():
    """aiak's grad_accumulation: 2 under automatic optimization equals Lightning's accumulate_grad_batches=2, both
    clipping at 0.5 (1e-6; the clip is active: the unclipped run differs)."""
    with_aiak = _fit(Classifier({"grad_accumulation": 2}), gradient_clip_val=0.5)
    lightning = _fit(Classifier(), accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert max_abs_diff(with_aiak, lightning) < 1e-6
    unclipped = _fit(Classifier(), accumulate_grad_batches=2)
    assert max_abs_diff(unclipped, lightning) > 1e-3


def test_manual_optimization_with_grad_accumulation_equals_accumulating_by_hand():
    """Manual optimization (Lightning still passes a closure to step): aiak accumulating 2 with a step per batch
    equals stepping every 2nd batch on loss / 2 (1e-6)."""
    with_aiak = _fit(Classifier({"grad_accumulation": 2, **O2_BF16}, manual=True))
    by_hand = _fit(Classifier(O2_BF16, manual=True, manual_every=2))
    assert with_aiak.net[0].weight.dtype == torch.float32 and _compute_dtype(with_aiak) == torch.bfloat16
    for a, b in zip(with_aiak.state_dict().values(), by_hand.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_stacked_accumulation_warns_once_and_lightnings_wins():
    """accumulate_grad_batches=2 with aiak's grad_accumulation: 2: one warning naming Lightning's setting, and the
    run equals Lightning's accumulation alone (not 4x)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        stacked = _fit(Classifier({"grad_accumulation": 2}), accumulate_grad_batches=2)
    said = aiak_warnings(record)
    assert len(said) == 1 and "accumulate_grad_batches" in said[0] and "grad_accumulation: 2 is off" in said[0]
    alone = _fit(Classifier(), accumulate_grad_batches=2)
    assert max_abs_diff(stacked, alone) < 1e-6


def test_a_lightning_optimizer_is_unwrapped():
    """aiak.optimize given Lightning's LightningOptimizer patches the optimizer inside and returns the wrapper."""
    from pytorch_lightning.core.optimizer import LightningOptimizer

    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.5)
    wrapped = LightningOptimizer(inner)
    net, returned, _ = aiak.optimize(net, wrapped, strategy={"grad_accumulation": 2})
    assert returned is wrapped and inner._aiak_steps.accumulation == 2
    reference = copy.deepcopy(net)
    x, y = tensors(8)
    nn.functional.cross_entropy(net(x), y).backward()
    inner.step()  # a micro-step: weights unchanged
    assert max_abs_diff(net, reference) == 0.0


def test_the_callback_equals_optimize_inside_configure_optimizers():
    """AiakCallback(strategy) with a scheduler in the dict form: the same weights as calling aiak.optimize in
    configure_optimizers, and the scheduler advanced once per real step (4 of 8 batches)."""
    from aiak.integrations.lightning import AiakCallback

    class WithScheduler(Classifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            if self.strategy is not None:
                _, opt, _, sched = aiak.optimize(self, opt, strategy=self.strategy, scheduler=sched)
            self.scheduler = sched
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    strategy = {"grad_accumulation": 2, **O2_BF16}
    by_callback = _fit(WithScheduler(), callbacks=[AiakCallback(strategy)], gradient_clip_val=0.5)
    by_hand = _fit(WithScheduler(strategy), gradient_clip_val=0.5)
    assert by_callback.net[0].weight.dtype == torch.float32 and _compute_dtype(by_callback) == torch.bfloat16
    for a, b in zip(by_callback.state_dict().values(), by_hand.state_dict().values()):
        assert torch.equal(a, b)
    assert by_callback.scheduler.last_epoch == 4 and by_callback.scheduler.get_last_lr() == [0.5 * 0.5 ** 4]


class CallsItsSubmodule(Classifier):
    """The common Lightning idiom: the loss comes from ``self.net(x)``, not ``self(x)`` (``forward`` is bypassed)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def _plain_loop_calling_net(strategy, clip):
    """aiak applied to the LightningModule as the callback applies it, then a plain loop (zero_grad, loss from
    ``module.net(x)``, backward, clip, step): Lightning's automatic optimization of ``CallsItsSubmodule``."""
    module = Classifier()
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    module, opt, _ = aiak.optimize(module, opt, strategy=strategy)
    for x, y in _loader():
        opt.zero_grad()
        nn.functional.cross_entropy(module.net(x), y).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
    return module


def test_a_training_step_calling_self_net_with_grad_accumulation_equals_lightnings_accumulation():
    """A loss from ``self.net(x)`` under the callback's ``grad_accumulation: 2`` (aiak divides the summed gradients
    at the real step, wherever the loss came from) equals Lightning's ``accumulate_grad_batches=2`` without aiak,
    both clipping at 0.5. Exact: halving is exact in fp32, so ``(g1 + g2) / 2`` and ``g1 / 2 + g2 / 2`` agree."""
    from aiak.integrations.lightning import AiakCallback

    with_aiak = _fit(CallsItsSubmodule(), callbacks=[AiakCallback({"grad_accumulation": 2})], gradient_clip_val=0.5)
    lightning = _fit(CallsItsSubmodule(), accumulate_grad_batches=2, gradient_clip_val=0.5)
    for a, b in zip(with_aiak.state_dict().values(), lightning.state_dict().values()):
        assert torch.equal(a, b)
    unaccumulated = _fit(CallsItsSubmodule(), gradient_clip_val=0.5)
    assert max_abs_diff(unaccumulated, lightning) > 1e-3  # accumulation really happened


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_training_step_calling_self_net_computes_in_o2_like_the_plain_loop(dtype):
    """O2 through the callback with the loss from ``self.net(x)``: ``self.net`` opens the half-precision region
    (and, for fp16, scales the gradient inside it), so the weights are bit-identical to aiak's O2 in a plain loop
    calling ``module.net(x)`` (the same operations in the same order), the parameters stay fp32 while the layers
    compute in half, and the run differs from fp32 training by more than 1e-4 and by less than the bound the O2 bf16
    test above uses (2e-2; measured 2e-3), 8x tighter for fp16's three more mantissa bits (2.5e-3; measured 2e-4)."""
    from aiak.integrations.lightning import AiakCallback

    strategy = {"precision": {"level": "O2", "dtype": dtype}}
    fitted = _fit(CallsItsSubmodule(), callbacks=[AiakCallback(strategy)], gradient_clip_val=0.5)
    plain = _plain_loop_calling_net(strategy, clip=0.5)
    for a, b in zip(fitted.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)
    assert fitted.net[0].weight.dtype == torch.float32 and _compute_dtype(fitted) == HALF[dtype]
    if dtype == "fp16":  # aiak's own loss scaling was on and never had to skip
        scaler = fitted.trainer.optimizers[0]._aiak_steps.scaler
        assert scaler.grad_scale() == 2.0 ** 16 and scaler.skipped_steps == 0
    fp32 = _fit(CallsItsSubmodule(), gradient_clip_val=0.5)
    assert 1e-4 < max_abs_diff(fitted, fp32) < {"bf16": 2e-2, "fp16": 2.5e-3}[dtype]


def test_the_callback_closes_aiaks_window_at_each_epochs_last_batch():
    """11 batches per epoch (the last of 4 samples), aiak's grad_accumulation: 4 under the callback, two epochs:
    windows of 4, 4 and 3 batches, the last averaged over its 3 (timm's rule), equal to a plain loop doing that
    (1e-6), with nothing to warn about. Before, the third window ran on into the next epoch."""
    from aiak.integrations.lightning import AiakCallback

    def loader():
        x, y = tensors()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)

    module = Classifier()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AiakCallback({"grad_accumulation": 4, "tune": False})])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader())
    assert not aiak_warnings(record), aiak_warnings(record)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    batches = list(loader())
    assert len(batches) == 11
    for _ in range(2):
        for start in range(0, 11, 4):
            window = batches[start:start + 4]
            for x, y in window:
                (nn.functional.cross_entropy(net(x), y) / len(window)).backward()
            opt.step()
            opt.zero_grad()
    assert max_abs_diff(module.net, net) < 1e-6
