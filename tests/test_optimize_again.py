"""A model optimized once can be given to ``optimize()`` again with another optimizer: two optimizers of one
module (``aiak.optimize(self, optimizer)`` for each), or Lightning asking ``configure_optimizers`` again for a
second ``fit``. The model keeps what the first call applied; the new optimizer gets its own stepping."""
import torch
from torch import nn

import aiak


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _two_optimizers(model):
    first = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    return first, second


def _train(model, optimizers, batches):
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def test_two_optimizers_of_one_module_each_accumulate_like_plain_pytorch():
    """Each optimizer passed through optimize() with grad_accumulation 2 (the second with strategy='auto', which
    keeps the first call's strategy) equals plain PyTorch on the concatenated pairs of batches."""
    model = _model()
    first, second = _two_optimizers(model)
    strategy = {"grad_accumulation": 2}
    model, first, _ = aiak.optimize(model, first, strategy=strategy)
    model, second, _ = aiak.optimize(model, second)  # "auto": the model's strategy
    assert aiak.last_decision().strategy["grad_accumulation"] == 2
    batches = _batches(6)
    _train(model, [first, second], batches)

    reference = _model()
    ref_first, ref_second = _two_optimizers(reference)
    pairs = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(batches[::2], batches[1::2])]
    _train(reference, [ref_first, ref_second], pairs)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # a 2x4 sum halved vs a mean over 8: rounding only


def test_the_second_optimizer_shares_the_models_loss_scaler_and_steps_on_true_gradients():
    """O1 fp16: both optimizers' step controllers use the model's one loss scaler (the scale is applied inside
    the model's graph), so the second optimizer's gradients are unscaled like the first's."""
    model = _model()
    first, second = _two_optimizers(model)
    strategy = {"precision": {"level": "O1", "dtype": "fp16"}}
    model, first, _ = aiak.optimize(model, first, strategy=strategy)
    model, second, _ = aiak.optimize(model, second, strategy=strategy)  # the same model knobs: accepted too
    assert second._aiak_steps.scaler is first._aiak_steps.scaler is not None
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    reference = _model()
    nn.functional.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)  # fp16 compute; scale 65536 undone
