"""LAMB against a float64 transcription of Algorithm 2 of You et al. 2019, written here from the paper."""
import copy
import math

import pytest
import torch

from aiak.optim import Lamb

SHAPES = [(16, 8, 3, 3), (40,), (7, 13), (5,), (300, 20), (6, 4)]  # conv-like, 1-D, matrices
ZERO_PARAM = 3  # this parameter starts at 0: ||w|| = 0 -> trust ratio 1
STEPS = 20


def make_problem(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    params[ZERO_PARAM].zero_()
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) * (0.1 + i) for i, s in enumerate(SHAPES)]
             for _ in range(STEPS)]
    for step_grads in grads[::5]:
        step_grads[1].zero_()  # some steps have a zero gradient on a 1-D parameter
    return params, grads


def reference_lamb(params, grads, groups, *, lr, betas, eps, weight_decay, bias_correction=True, trust_clip=None,
                   max_grad_norm=None):
    """Plain float64 LAMB; ``groups[i]`` is False when parameter i has adaptation and decay turned off."""
    b1, b2 = betas
    w = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        scale = 1.0
        if max_grad_norm is not None:
            total = math.sqrt(sum(float((g * g).sum()) for g in step_grads))
            scale = max_grad_norm / total if total > max_grad_norm else 1.0
        for i, g in enumerate(step_grads):
            g = g * scale
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1 ** t) if bias_correction else m[i]
            v_hat = v[i] / (1 - b2 ** t) if bias_correction else v[i]
            decay = weight_decay if groups[i] else 0.0
            u = m_hat / (v_hat.sqrt() + eps) + decay * w[i]
            ratio = 1.0
            if groups[i]:
                w_norm, u_norm = float(w[i].norm()), float(u.norm())
                ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                if trust_clip is not None:
                    ratio = min(ratio, trust_clip)
            w[i] = w[i] - lr * ratio * u
    return w


def run_lamb(params64, grads, adapt_mask, dtype=torch.float32, steps=STEPS, **kw):
    params = [torch.nn.Parameter(p.to(dtype)) for p in params64]
    decay = kw.pop("weight_decay", 0.0)
    groups = [{"params": [p for p, a in zip(params, adapt_mask) if a], "weight_decay": decay},
              {"params": [p for p, a in zip(params, adapt_mask) if not a], "weight_decay": 0.0, "adapt": False}]
    opt = Lamb([g for g in groups if g["params"]], **kw)
    for step_grads in grads[:steps]:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


CONFIGS = {
    "plain": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0),
    "decay": dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "clip-trust-and-grad": dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, trust_clip=0.5,
                                max_grad_norm=1.0),
    "no-bias-correction": dict(lr=0.005, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.05, bias_correction=False),
}
ALL_ADAPT = [True] * len(SHAPES)
MIXED = [True, False, True, True, True, False]  # a 1-D and a matrix parameter excluded


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("path", ["foreach", "foreach-cut", "single"])
@pytest.mark.parametrize("mask", [ALL_ADAPT, MIXED], ids=["adapt-all", "adapt-mixed"])
def test_matches_float64_reference(config, path, mask, assert_matches_reference):
    params64, grads = make_problem()
    kw = dict(CONFIGS[config])
    expected = reference_lamb(params64, grads, mask, **kw)
    opts = {"foreach": dict(foreach=True), "foreach-cut": dict(foreach=True, bucket_elems=100),
            "single": dict(foreach=False)}[path]
    got, _ = run_lamb(params64, grads, mask, **kw, **opts)
    assert_matches_reference(got, expected, params64, ZERO_PARAM)


def test_trust_ratio_changes_the_step():
    """Against the same run with adaptation off the parameters differ: the ratio is really applied."""
    params64, grads = make_problem()
    adapted, _ = run_lamb(params64, grads, ALL_ADAPT, **CONFIGS["decay"])
    plain, _ = run_lamb(params64, grads, [False] * len(SHAPES), **CONFIGS["decay"])
    assert not torch.allclose(adapted[0], plain[0], rtol=1e-3)


@pytest.mark.parametrize("config", ["decay", "clip-trust-and-grad"])
@pytest.mark.parametrize("bucket_elems", [None, 0, 64, 1000])
def test_multi_tensor_equals_single_tensor(bucket_elems, config):
    params64, grads = make_problem(seed=1)
    kw = CONFIGS[config]
    single, _ = run_lamb(params64, grads, MIXED, foreach=False, **kw)
    multi, _ = run_lamb(params64, grads, MIXED, foreach=True, bucket_elems=bucket_elems, **kw)
    for s, m in zip(single, multi):  # only the summation order of the norms differs (fp32 rounding)
        torch.testing.assert_close(m, s, rtol=1e-6, atol=1e-6 * s.detach().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_equals_uninterrupted(dtype, assert_resume_equals_uninterrupted):
    params64, grads = make_problem(seed=2)
    assert_resume_equals_uninterrupted(run_lamb, Lamb, params64, grads, MIXED, dtype, "exp_avg",
                                       **CONFIGS["decay"], bucket_elems=100)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("foreach, bucket_elems", [(True, None), (True, 100), (False, None)])
def test_half_parameters_use_fp32_math(dtype, foreach, bucket_elems, rounded_fp32_reference):
    """Half parameters: fp32 moments; each step equals the fp32 step of the rounded weights, rounded once."""
    params64, grads = make_problem(seed=3)
    kw = CONFIGS["decay"]
    half, opt = run_lamb(params64, grads, MIXED, dtype=dtype, steps=5, foreach=foreach, bucket_elems=bucket_elems,
                          **kw)
    assert all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
               for s in opt.state.values())
    fp32 = rounded_fp32_reference(Lamb, params64, grads, MIXED, kw, dtype, 5, foreach=foreach,
                                  bucket_elems=bucket_elems)
    for h, f in zip(half, fp32):
        assert h.dtype == dtype
        torch.testing.assert_close(h.float(), f, rtol=0, atol=0)


def test_small_model_converges():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 1))
    x = torch.randn(128, 8)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh()
    from aiak.optim import create
    opt = create("lamb", model, lr=0.02, weight_decay=1e-4)
    first = None
    for _ in range(60):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 * first


def test_sparse_gradients_are_refused_before_any_update():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Parameter(torch.ones(3, 3))
    opt = Lamb([dense, emb.weight], lr=0.1)
    dense.grad = torch.ones(3, 3)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert torch.equal(dense, torch.ones(3, 3))


@pytest.mark.parametrize("kw, name", [
    (dict(lr=-1.0), "lr"), (dict(lr=0.1, betas=(1.0, 0.9)), "betas"), (dict(lr=0.1, betas=(0.9,)), "betas"),
    (dict(lr=0.1, eps=-1e-8), "eps"), (dict(lr=0.1, weight_decay=float("nan")), "weight_decay"),
    (dict(lr=0.1, trust_clip=0.0), "trust_clip"), (dict(lr=0.1, max_grad_norm=-1.0), "max_grad_norm"),
    (dict(lr=0.1, bucket_elems=-5), "bucket_elems"), (dict(lr="0.1"), "lr"),
])
def test_bad_hyperparameters_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        Lamb([torch.nn.Parameter(torch.ones(2))], **kw)


def test_bad_group_override_is_refused():
    with pytest.raises(ValueError, match="weight_decay"):
        Lamb([{"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": -1.0}], lr=0.1)


def test_channels_last_and_non_contiguous_gradients():
    """Layouts the bucketing must respect: a channels_last weight larger than a bucket, a transposed grad."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(32, 16, 3, 3), (64, 40)]
    results = []
    for foreach, bucket_elems in ((False, None), (True, 500)):
        conv = torch.nn.Parameter(torch.randn(shapes[0], generator=torch.Generator().manual_seed(5))
                                  .to(memory_format=torch.channels_last))
        mat = torch.nn.Parameter(torch.randn(shapes[1], generator=torch.Generator().manual_seed(6)))
        opt = Lamb([conv, mat], lr=0.01, weight_decay=0.1, foreach=foreach, bucket_elems=bucket_elems)
        gen.manual_seed(7)
        for _ in range(3):
            conv.grad = torch.randn(shapes[0], generator=gen).to(memory_format=torch.channels_last)
            mat.grad = torch.randn(tuple(reversed(shapes[1])), generator=gen).t()  # non-contiguous
            opt.step()
        results.append((conv.detach().clone(), mat.detach().clone()))
    for single, multi in zip(*results):
        torch.testing.assert_close(multi, single, rtol=1e-6, atol=1e-6 * single.abs().max().item())


def test_float64_parameters_keep_float64_math():
    params64, grads = make_problem(seed=5)
    kw = CONFIGS["decay"]
    expected = reference_lamb(params64, grads, MIXED, **kw)
    got, opt = run_lamb(params64, grads, MIXED, dtype=torch.float64, **kw)
    assert all(s["exp_avg"].dtype == torch.float64 for s in opt.state.values())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.detach(), e, rtol=1e-10, atol=1e-12)


def test_replaced_parameters_get_a_new_plan_and_old_ones_are_released():
    """O2 swaps the tensors in param_groups for fp32 masters: the cached buckets must follow them."""
    params64, grads = make_problem(seed=6)
    params = [torch.nn.Parameter(p.float()) for p in params64]
    opt = Lamb(params, lr=0.01, weight_decay=0.1, bucket_elems=100)
    for p, g in zip(params, grads[0]):
        p.grad = g.float()
    opt.step()
    masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt.param_groups[0]["params"] = masters
    for old, new in zip(params, masters):
        opt.state[new] = opt.state.pop(old)
        new.grad = torch.ones_like(new)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))  # the old tensors are no longer touched
    assert all(not torch.equal(m, b) for m, b in zip(masters, before) if m.abs().sum() > 0)
    assert len(opt._plans._plans) == 1  # the plan of the replaced tensors was dropped


def _count_fused_adam_calls(opt) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_fused_adam_")


@pytest.mark.parametrize("bucket_elems", [None, 100])
def test_default_path_runs_torchs_fused_adam_kernel_and_no_bias_correction_does_not(bucket_elems):
    """The fast path (moments and update in one fused pass) is what runs by default on CPU; the
    float64-reference tests above then check its result for every config that takes it."""
    params64, grads = make_problem()
    _, opt = run_lamb(params64, grads, MIXED, steps=1, bucket_elems=bucket_elems, **CONFIGS["decay"])
    assert _count_fused_adam_calls(opt) > 0
    _, opt = run_lamb(params64, grads, MIXED, steps=1, bucket_elems=bucket_elems,
                      **CONFIGS["no-bias-correction"])
    assert _count_fused_adam_calls(opt) == 0


def test_mixed_layouts_of_weight_grad_and_state_stay_exact():
    """A fused kernel that walks raw memory must not pair a channels_last weight with contiguous moments (a
    checkpoint saved before ``channels_last``) or with a contiguous gradient: such buckets take the
    layout-aware foreach ops. Multi-tensor must equal the per-tensor loop, which has no such pitfall."""
    gen = torch.Generator().manual_seed(8)
    conv0 = torch.randn(8, 6, 3, 3, generator=gen)
    mat0 = torch.randn(20, 30, generator=gen)
    grads = [(torch.randn(8, 6, 3, 3, generator=gen), torch.randn(20, 30, generator=gen)) for _ in range(6)]

    def run(foreach):
        conv, mat = torch.nn.Parameter(conv0.clone()), torch.nn.Parameter(mat0.clone())
        opt = Lamb([conv, mat], lr=0.01, weight_decay=0.1, foreach=foreach, bucket_elems=1000)
        for gc, gm in grads[:3]:  # contiguous weights, grads and moments
            conv.grad, mat.grad = gc.clone(), gm.clone()
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        with torch.no_grad():  # the model goes channels_last after the checkpoint
            conv.data = conv.data.contiguous(memory_format=torch.channels_last)
        opt = Lamb([conv, mat], lr=1.0, foreach=foreach, bucket_elems=1000)
        opt.load_state_dict(saved)
        assert opt.state[conv]["exp_avg"].is_contiguous()  # the moments kept the checkpoint's layout
        for i, (gc, gm) in enumerate(grads[3:]):
            conv.grad = gc.clone() if i % 2 else gc.contiguous(memory_format=torch.channels_last)
            mat.grad = gm.clone() if i % 2 else gm.t().contiguous().t()  # column-major gradient
            opt.step()
        return conv.detach(), mat.detach()

    for multi, single in zip(run(True), run(False)):
        torch.testing.assert_close(multi, single, rtol=1e-6, atol=1e-6 * single.abs().max().item())
