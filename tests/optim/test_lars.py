"""LARS against a float64 transcription of Algorithm 1 of You et al. 2017 (+ LARC clipping), written here."""
import pytest
import torch

from aiak.optim import Lars

SHAPES = [(16, 8, 3, 3), (40,), (7, 13), (5,), (300, 20), (6, 4)]
ZERO_PARAM = 3
STEPS = 20


def make_problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    params[ZERO_PARAM].zero_()
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) * (0.1 + i) for i, s in enumerate(SHAPES)]
             for _ in range(STEPS)]
    for step_grads in grads[::5]:
        step_grads[1].zero_()
    return params, grads


def reference_lars(params, grads, adapt, *, lr, momentum, weight_decay, trust_coefficient, eps, nesterov=False,
                   clip=False):
    """Plain float64 LARS; ``adapt[i]`` False: plain SGD momentum without decay for parameter i."""
    w = [p.clone() for p in params]
    buf = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            decay = weight_decay if adapt[i] else 0.0
            local = 1.0
            w_norm, g_norm = float(w[i].norm()), float(g.norm())
            if adapt[i] and w_norm > 0 and g_norm > 0:
                local = trust_coefficient * w_norm / (g_norm + decay * w_norm + eps)
                if clip:
                    local = min(local / lr, 1.0)
            d = local * (g + decay * w[i])
            buf[i] = momentum * buf[i] + d
            step = d + momentum * buf[i] if nesterov else buf[i]
            w[i] = w[i] - lr * step
    return w


def run_lars(params64, grads, adapt_mask, dtype=torch.float32, steps=STEPS, **kw):
    params = [torch.nn.Parameter(p.to(dtype)) for p in params64]
    decay = kw.pop("weight_decay", 0.0)
    groups = [{"params": [p for p, a in zip(params, adapt_mask) if a], "weight_decay": decay},
              {"params": [p for p, a in zip(params, adapt_mask) if not a], "weight_decay": 0.0, "adapt": False}]
    opt = Lars([g for g in groups if g["params"]], **kw)
    for step_grads in grads[:steps]:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


CONFIGS = {
    "plain": dict(lr=0.5, momentum=0.9, weight_decay=0.0, trust_coefficient=0.02, eps=1e-8),
    "decay": dict(lr=0.3, momentum=0.9, weight_decay=0.05, trust_coefficient=0.01, eps=1e-8),
    "nesterov": dict(lr=0.3, momentum=0.8, weight_decay=1e-3, trust_coefficient=0.05, eps=1e-8, nesterov=True),
    "larc-clip": dict(lr=0.05, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8, clip=True),
    "no-momentum": dict(lr=0.3, momentum=0.0, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8),
}
ALL_ADAPT = [True] * len(SHAPES)
MIXED = [True, False, True, True, True, False]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("path", ["foreach", "foreach-cut", "single"])
@pytest.mark.parametrize("mask", [ALL_ADAPT, MIXED], ids=["adapt-all", "adapt-mixed"])
def test_matches_float64_reference(config, path, mask, assert_matches_reference):
    params64, grads = make_problem()
    kw = dict(CONFIGS[config])
    expected = reference_lars(params64, grads, mask, **kw)
    opts = {"foreach": dict(foreach=True), "foreach-cut": dict(foreach=True, bucket_elems=100),
            "single": dict(foreach=False)}[path]
    got, _ = run_lars(params64, grads, mask, **kw, **opts)
    assert_matches_reference(got, expected, params64, ZERO_PARAM)


def test_larc_clip_really_clips():
    """With a large trust coefficient the clipped run differs from the unclipped one."""
    params64, grads = make_problem()
    kw = CONFIGS["larc-clip"]
    clipped, _ = run_lars(params64, grads, ALL_ADAPT, **kw)
    unclipped, _ = run_lars(params64, grads, ALL_ADAPT, **{**kw, "clip": False})
    assert not torch.allclose(clipped[0], unclipped[0], rtol=1e-3)


@pytest.mark.parametrize("config", ["decay", "nesterov", "larc-clip"])
@pytest.mark.parametrize("bucket_elems", [None, 0, 64, 1000])
def test_multi_tensor_equals_single_tensor(bucket_elems, config):
    params64, grads = make_problem(seed=1)
    single, _ = run_lars(params64, grads, MIXED, foreach=False, **CONFIGS[config])
    multi, _ = run_lars(params64, grads, MIXED, foreach=True, bucket_elems=bucket_elems, **CONFIGS[config])
    for s, m in zip(single, multi):  # only the summation order of the norms differs (fp32 rounding)
        torch.testing.assert_close(m, s, rtol=1e-6, atol=1e-6 * s.detach().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_dict_resume_equals_uninterrupted(dtype, assert_resume_equals_uninterrupted):
    params64, grads = make_problem(seed=2)
    assert_resume_equals_uninterrupted(run_lars, Lars, params64, grads, MIXED, dtype, "momentum_buffer",
                                       **CONFIGS["nesterov"], bucket_elems=100)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("foreach, bucket_elems", [(True, None), (True, 100), (False, None)])
def test_half_parameters_use_fp32_math(dtype, foreach, bucket_elems, rounded_fp32_reference):
    params64, grads = make_problem(seed=3)
    kw = CONFIGS["decay"]
    half, opt = run_lars(params64, grads, MIXED, dtype=dtype, steps=5, foreach=foreach, bucket_elems=bucket_elems,
                          **kw)
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in opt.state.values())
    fp32 = rounded_fp32_reference(Lars, params64, grads, MIXED, kw, dtype, 5, foreach=foreach,
                                  bucket_elems=bucket_elems)
    for h, f in zip(half, fp32):
        assert h.dtype == dtype
        torch.testing.assert_close(h.float(), f, rtol=0, atol=0)


def test_small_model_converges():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    x = torch.randn(128, 8)
    y = x[:, :1] * 2 - x[:, 1:2]
    from aiak.optim import create
    opt = create("lars", model, lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02)
    first = None
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 * first


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Lars(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


@pytest.mark.parametrize("kw, name", [
    (dict(lr=-1.0), "lr"), (dict(lr=0.1, momentum=1.0), "momentum"), (dict(lr=0.1, weight_decay=-1.0), "weight_decay"),
    (dict(lr=0.1, trust_coefficient=0.0), "trust_coefficient"), (dict(lr=0.1, eps=-1.0), "eps"),
    (dict(lr=0.1, momentum=0.0, nesterov=True), "nesterov"), (dict(lr=0.1, bucket_elems=1.5), "bucket_elems"),
])
def test_bad_hyperparameters_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        Lars([torch.nn.Parameter(torch.ones(2))], **kw)
