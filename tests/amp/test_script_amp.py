"""A script's own AMP beside aiak's precision: torchvision's reference ``--amp`` loop, unchanged, on CPU.

The loop (torchvision ``references/classification/train.py``): ``torch.autocast`` around the forward and the loss,
``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)`` before ``clip_grad_norm_``, ``scaler.step``,
``scaler.update``. Under aiak's O1/O2 the parameters stay fp32, so the script's ``torch.amp.GradScaler`` unscales and
steps them as it would without aiak; aiak's own fp16 loss scaling stands aside (one warning) so the two scalers never
multiply. Each run is compared, weight for weight, with the same computation done without aiak's help (see
``CASES``); the comparisons are exact (``torch.equal``), for the reasons given there.

The once-only warning keys are process-wide: every test starts with them cleared, and monkeypatch puts them back
afterwards.
"""
import warnings

import pytest
import torch
from torch import nn

import aiak
from aiak.util import warn

STEPS = 30
CLIP = 1.0
O1_FP16 = {"precision": {"level": "O1", "dtype": "fp16"}}
O1_BF16 = {"precision": {"level": "O1", "dtype": "bf16"}}
O2_BF16 = {"precision": {"level": "O2", "dtype": "bf16"}}
O2_FP16 = {"precision": {"level": "O2", "dtype": "fp16"}}
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
WARNING = "the script's torch.amp.GradScaler scales the loss"


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch):
    monkeypatch.setattr(warn, "_warned", set())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 3))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=g) * 4, torch.randint(0, 3, (16,), generator=g)


def _train(strategy=None, autocast=None, grad_scaler=True, steps=STEPS):
    """torchvision's ``--amp`` loop; ``strategy``: passed to ``aiak.optimize`` (None: no aiak); ``autocast``: the
    script's autocast dtype ("fp16"/"bf16"; None: no autocast); ``grad_scaler``: the script's GradScaler enabled.
    Returns the model, the optimizer and the GradScaler's scale and the clip's norm after every step."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if strategy is not None:
        model, optimizer, _ = aiak.optimize(model, optimizer, strategy=strategy)
    scaler = torch.amp.GradScaler("cpu", enabled=grad_scaler)
    scales, norms = [], []
    for step in range(steps):
        x, y = _batch(step)
        with torch.autocast("cpu", dtype=HALF.get(autocast), enabled=autocast is not None):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return model, optimizer, scales, norms


# name: (aiak's strategy, the script's autocast dtype, the reference run's _train arguments)
CASES = {
    # The same computation: aiak's O1 region opens the autocast the script already has, casts the model's half
    # output to fp32 (cross_entropy is on autocast's fp32 list, so the script's autocast does that cast anyway) and,
    # for fp16, multiplies the gradients by its loss scale, which is 1 while the script's GradScaler is in charge.
    "O1 fp16": (O1_FP16, "fp16", dict(strategy=None, autocast="fp16")),
    "O1 bf16": (O1_BF16, "bf16", dict(strategy=None, autocast="bf16")),
    # aiak's O2 without the script's AMP: the script's autocast is switched off inside the O2 region and
    # cross_entropy of fp32 logits is fp32 under it; the GradScaler multiplies the loss by 2**16 and the fp32
    # gradients by 2**-16, and scaling by a power of two is exact in fp32, bf16 and fp16 (no step overflows: the
    # scale stays at 2**16), so every gradient is the one aiak's O2 computes alone (for fp16, aiak's own 2**16 is
    # applied at the backward's root and removed where each gradient lands: the same values in the region).
    "O2 bf16": (O2_BF16, "bf16", dict(strategy=O2_BF16, grad_scaler=False)),
    "O2 fp16": (O2_FP16, "fp16", dict(strategy=O2_FP16, grad_scaler=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_reference_scripts_amp_loop_trains_and_equals_the_same_precision_done_by_hand(case, monkeypatch):
    """30 steps of the loop with aiak: the GradScaler never skips a step (its scale stays 2**16; aiak's previous
    design skipped 15 of 30 under O1 fp16 and the scale fell to 2), the clip is active, the parameters stay the
    user's fp32 tensors, and the weights are bit-identical to the reference of ``CASES`` (and not to fp32
    training: the precision is really applied)."""
    strategy, autocast, reference = CASES[case]
    model, optimizer, scales, norms = _train(strategy, autocast)
    assert scales == [2.0 ** 16] * STEPS
    assert sum(n > CLIP for n in norms) >= 5  # clipping really happens, on the unscaled gradients
    assert all(p.dtype == torch.float32 for p in model.parameters())
    controller = getattr(optimizer, "_aiak_steps", None)
    if strategy["precision"]["dtype"] == "fp16":  # aiak's loss scaler exists but stood aside: never skipped
        assert controller.scaler.grad_scale() == 1.0 and controller.scaler.skipped_steps == 0

    expected, _, _, expected_norms = _train(**reference)
    assert norms == expected_norms
    for (name, a), b in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), name
    fp32, _, _, _ = _train(grad_scaler=False)
    assert max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                          fp32.state_dict().values())) > 1e-4


def test_aiak_says_once_that_the_scripts_grad_scaler_does_the_loss_scaling():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _train(O1_FP16, "fp16", steps=4)
        _train(O2_FP16, "fp16", steps=2)  # a second model in the same process: nothing new to say
    said = [str(w.message) for w in record if WARNING in str(w.message)]
    assert len(said) == 1 and said[0].startswith("aiak:"), said


@pytest.mark.filterwarnings("ignore:aiak. the script's torch.amp.GradScaler")
def test_a_grad_scaler_on_one_model_leaves_another_aiak_models_loss_scaling_alone():
    """Only the model whose loss the script's GradScaler scales hands its loss scaling over: a second aiak fp16
    model in the process keeps scaling by 65536 inside its graph, and its gradients equal those of a process that
    never saw a GradScaler (bit for bit)."""
    def grads():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))
        model, optimizer, _ = aiak.optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=O2_FP16)
        x = torch.randn(16, 12, generator=torch.Generator().manual_seed(0))
        (model(x).pow(2).mean() * 1e-4).backward()
        return [p.grad for p in model.parameters()], optimizer._aiak_steps.scaler

    before, _ = grads()
    _train(O2_FP16, steps=1)  # a GradScaler scales another aiak model's loss
    after, scaler = grads()
    assert scaler.grad_scale() == 2.0 ** 16 and not scaler.stood_aside
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("precision", [{"level": "O1", "dtype": "fp16"}, {"level": "O0"}])
def test_a_script_grad_scaler_with_aiak_grad_accumulation_is_refused(precision):
    """GradScaler.unscale_ would divide the window's partial sums again at every micro-step: refused at the first
    unscale_, before anything was stepped, naming both and what to change."""
    with pytest.raises(RuntimeError, match=r"GradScaler.*grad_accumulation: 2.*grad_accumulation: 1"):
        _train({"precision": precision, "grad_accumulation": 2}, "fp16" if precision["level"] != "O0" else None)
