"""The bucketing machinery shared by LAMB and LARS, and the accelerator form of its per-tensor scalars."""
import pytest
import torch

import aiak.optim._multi_tensor as mt
from aiak.optim import Lamb, Lars


def test_plan_packs_small_tensors_and_cuts_large_contiguous_ones():
    tensors = [torch.zeros(30), torch.zeros(50), torch.zeros(250), torch.zeros(10, 30).t(), torch.zeros(5)]
    buckets, cut = mt.plan_buckets(tensors, 100)
    assert cut == [False, False, True, False, False]  # the transposed 300-element tensor stays whole
    assert sorted(buckets) == sorted([[(0, 0, 30), (1, 0, 50)], [(2, 0, 100)], [(2, 100, 200)], [(2, 200, 250)],
                                      [(3, 0, 300)], [(4, 0, 5)]])
    pieces = [k for k, b in enumerate(buckets) if b[0][0] == 2]
    assert pieces == list(range(pieces[0], pieces[0] + 3))  # a cut tensor's pieces are consecutive
    one, cut = mt.plan_buckets(tensors, None)
    assert len(one) == 1 and not any(cut)


@pytest.mark.parametrize("cls, kw", [
    (Lamb, dict(lr=0.01, weight_decay=0.1, trust_clip=2.0)),
    (Lars, dict(lr=0.1, weight_decay=0.01, trust_coefficient=0.02, nesterov=True)),
    (Lars, dict(lr=0.1, weight_decay=0.01, trust_coefficient=0.02, momentum=0.0)),
])
@pytest.mark.parametrize("bucket_elems", [0, 100])
def test_host_scalar_form_equals_the_cpu_form(monkeypatch, cls, kw, bucket_elems):
    """On GPUs the per-tensor trust ratios reach foreach as host floats; run that form here and compare."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 4, 3, 3), (20,), (30, 12)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]

    def run(host):
        monkeypatch.setattr(mt, "FORCE_HOST_SCALARS", host)
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = cls(params, bucket_elems=bucket_elems, **kw)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g
            opt.step()
        return params

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * a.detach().abs().max().item())


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_step_with_a_closure_computes_the_loss_with_grad_and_steps(name):
    from aiak.optim import create

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    before = model.weight.detach().clone()
    opt = create(name, model, lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # needs grad enabled inside the (no_grad) step
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.requires_grad
    assert not torch.equal(model.weight, before)


def test_dense_strides_and_same_layout():
    """Scratch follows a dense parameter's own layout; a gapped view gets contiguous strides."""
    cl = torch.zeros(4, 3, 5, 5).to(memory_format=torch.channels_last)
    assert mt.dense_strides(cl) == cl.stride()
    permuted = torch.zeros(3, 4, 5).permute(2, 0, 1)
    assert mt.dense_strides(permuted) == permuted.stride()
    gapped = torch.zeros(6, 8)[:, :5]
    assert mt.dense_strides(gapped) == (5, 1)
    assert mt.same_layout([cl], [torch.zeros_like(cl)])
    assert not mt.same_layout([cl], [torch.zeros(4, 3, 5, 5)])
    assert not mt.same_layout([gapped], [gapped])  # not dense: a raw-memory kernel would touch the gaps
