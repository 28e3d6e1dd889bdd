"""Sparse gradients (``nn.Embedding(..., sparse=True)``) under aiak: accumulation, clipping with the user's
``torch.nn.utils.clip_grad_norm_``, O2 bf16 and O1/O2 fp16 with loss scaling, each against plain fp32 PyTorch
doing the same by hand (manual accumulation of ``loss / 2``, the same clipping); and an overflow in the sparse
gradient under loss scaling skips the step.

Plain PyTorch 2.14 clips sparse gradients (``get_total_norm`` and the in-place scaling of
``clip_grads_with_norm_`` accept them), and ``torch.optim.SGD`` steps them; so under aiak the same loop must do
the same. The fp16 cases run emulated on a CPU: the model is tiny.
"""
import copy

import pytest
import torch
from torch import nn

import aiak

VOCAB, DIM, CLASSES, SEQ, BATCH = 16, 8, 3, 5, 6
ACCUMULATION = 2
REAL_STEPS = 3
MAX_NORM = 0.1
LR = 0.5

# Stated tolerances, on each parameter's total update (final - initial weights) against the fp32 reference,
# elementwise, the absolute part relative to the largest update of that parameter. fp32 differs from the
# reference only by the order of additions; bf16 computes with 8 mantissa bits, fp16 with 11.
TOLERANCE = {None: (1e-5, 1e-6), "bf16": (3e-2, 2e-2), "fp16": (5e-3, 2e-3)}


class Bag(nn.Module):
    """Embedding (sparse gradient) -> mean over tokens -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    # rows VOCAB - 4 .. VOCAB - 1 never appear: their weights must not move under any precision
    return [(torch.randint(0, VOCAB - 4, (BATCH, SEQ), generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(n)]


def _fresh():
    torch.manual_seed(0)
    return Bag()  # true gradient norms 0.27 .. 0.49 (> 2 * MAX_NORM); loss-scaled by 2**16 they stay < 65504


def _reference(model, batches, max_norm=MAX_NORM):
    """Plain fp32 PyTorch: manual accumulation of loss / ACCUMULATION, clipping, step. Returns the norms."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for i in range(0, len(batches), ACCUMULATION):
        for tokens, labels in batches[i:i + ACCUMULATION]:
            (nn.functional.cross_entropy(model(tokens), labels) / ACCUMULATION).backward()
        assert model.emb.weight.grad.is_sparse
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _aiak_loop(model, optimizer, batches, max_norm=MAX_NORM):
    """The user's unchanged loop: one backward, clip and step() per micro-batch. Returns the clip norms and
    whether the embedding's gradient was sparse at each clip."""
    norms, sparse = [], []
    for tokens, labels in batches:
        nn.functional.cross_entropy(model(tokens), labels).backward()
        sparse.append(model.emb.weight.grad.is_sparse)
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms, sparse


def _strategy(level, dtype):
    precision = {"level": level, "dtype": dtype} if dtype else {"level": "O0"}
    return {"precision": precision, "grad_accumulation": ACCUMULATION}


CASES = [("O0", None), ("O2", "bf16"), ("O1", "fp16"), ("O2", "fp16")]


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("level,dtype", CASES, ids=[f"{lv}-{dt or 'fp32'}" for lv, dt in CASES])
def test_sparse_embedding_matches_plain_fp32(level, dtype, clip):
    max_norm = MAX_NORM if clip else None
    batches = _batches(REAL_STEPS * ACCUMULATION)
    initial = _fresh()
    reference = copy.deepcopy(initial)
    ref_norms = _reference(reference, batches, max_norm)
    if clip:
        assert all(n > 2 * MAX_NORM for n in ref_norms), "clipping must act for the comparison to mean anything"

    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=_strategy(level, dtype))
    if dtype == "fp16":
        scaler = optimizer._aiak_steps.scaler
        assert scaler is not None and scaler.scale > 1  # loss scaling is on
    norms, sparse = _aiak_loop(model, optimizer, batches, max_norm)

    assert all(sparse), "the fp32 parameter's gradient is sparse, as in plain PyTorch"
    assert model.emb.weight.dtype == torch.float32
    if dtype == "fp16":
        assert optimizer._aiak_steps.scaler.skipped_steps == 0
    rtol, atol = TOLERANCE[dtype]
    if clip:
        real = norms[ACCUMULATION - 1::ACCUMULATION]  # what clip_grad_norm_ returned before each real step
        torch.testing.assert_close(torch.stack(real), torch.stack(ref_norms), rtol=rtol, atol=0)
        assert all(torch.isfinite(n) for n in norms)
    for name, p in model.named_parameters():
        start, expected = dict(initial.named_parameters())[name], dict(reference.named_parameters())[name]
        moved, expected_moved = (p - start).detach(), (expected - start).detach()
        assert expected_moved.abs().max() > 0
        torch.testing.assert_close(moved, expected_moved, rtol=rtol, atol=atol * float(expected_moved.abs().max()),
                                   msg=f"{name} under {level} {dtype}")
    # embedding rows no batch used are untouched, bit for bit
    assert torch.equal(model.emb.weight[VOCAB - 4:], initial.emb.weight[VOCAB - 4:])


def test_per_micro_step_clipping_would_be_caught():
    """The reference comparison fails for a loop that clips every micro-batch's gradient on its own (what aiak
    must not do): so the clip test above checks that the whole window is clipped once."""
    batches = _batches(REAL_STEPS * ACCUMULATION)
    initial = _fresh()
    reference = copy.deepcopy(initial)
    _reference(reference, batches)
    wrong = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(wrong.parameters(), lr=LR)
    for i in range(0, len(batches), ACCUMULATION):
        for tokens, labels in batches[i:i + ACCUMULATION]:
            (nn.functional.cross_entropy(wrong(tokens), labels) / ACCUMULATION).backward()
            torch.nn.utils.clip_grad_norm_(wrong.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    rtol, atol = TOLERANCE["bf16"]  # the loosest stated tolerance
    moved, expected = wrong.head.weight - initial.head.weight, reference.head.weight - initial.head.weight
    assert not torch.allclose(moved, expected, rtol=rtol, atol=atol * float(expected.abs().max()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_inf_in_the_sparse_gradient_skips_the_step(level):
    """fp16 loss scaling: an inf injected into the embedding's sparse gradient (a tensor hook, on the first
    micro-batch of the second window) makes that real step a skipped one: weights unchanged, the loss scale
    halved, clip_grad_norm_ returns inf; the windows before and after step normally."""
    batches = _batches(3 * ACCUMULATION)
    model = _fresh()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer, _ = aiak.optimize(model, optimizer, strategy=_strategy(level, "fp16"))
    scaler = optimizer._aiak_steps.scaler
    inject = {"at": ACCUMULATION}  # micro-batch index

    def poison(grad):
        if inject.get("at") != micro:
            return grad
        del inject["at"]
        assert grad.is_sparse
        values = grad._values().clone()
        values[0, 0] = float("inf")
        return torch.sparse_coo_tensor(grad._indices(), values, grad.shape, check_invariants=True)

    model.emb.weight.register_hook(poison)
    snapshots, norms = [], []
    for micro, (tokens, labels) in enumerate(batches):
        if micro % ACCUMULATION == 0:
            snapshots.append((copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"]),
                              scaler.scale))
        nn.functional.cross_entropy(model(tokens), labels).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
    snapshots.append((copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()["state"]),
                      scaler.scale))

    (w0, _, s0), (w1, st1, s1), (w2, st2, s2), (w3, _, s3) = snapshots
    assert "at" not in inject, "the inf was injected"
    assert not torch.equal(w0["emb.weight"], w1["emb.weight"]), "the first window stepped"
    for name in w1:  # the poisoned window: skipped
        assert torch.equal(w1[name], w2[name]), name
    dense = lambda t: t.to_dense() if t.is_sparse else t  # noqa: E731  (SGD's momentum buffer of a sparse grad)
    assert st1, "the first window stepped"
    for i in st1:
        assert torch.equal(dense(st1[i]["momentum_buffer"]), dense(st2[i]["momentum_buffer"]))
    assert s2 == s1 / 2 and s1 == s0 and s3 == s2
    assert scaler.skipped_steps == 1
    # the norm accumulated so far is inf from the poisoned micro-batch on, up to that window's real step
    poisoned = range(ACCUMULATION, 2 * ACCUMULATION)
    assert all(torch.isinf(norms[i]) for i in poisoned), norms
    assert all(torch.isfinite(n) for i, n in enumerate(norms) if i not in poisoned), norms
    assert not torch.equal(w2["emb.weight"], w3["emb.weight"]), "the window after the overflow stepped"
    assert all(torch.isfinite(t).all() for t in w3.values())
