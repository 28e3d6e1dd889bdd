"""Which ops autocast runs in fp32, asked of torch on fake tensors (aiak.amp.autocast_policy): the answers match what
autocast does with real tensors, on this CPU, and a call the probe cannot make counts as not fp32."""
import pytest
import torch
from torch.nn import functional as F

from aiak.amp.autocast_policy import runs_in_fp32

CASES = [
    ("cdist", torch.cdist, (torch.randn(3, 4), torch.randn(5, 4)), {}),
    ("quantile", torch.quantile, (torch.randn(8), 0.5), {}),
    ("inverse", torch.inverse, (torch.randn(4, 4),), {}),
    ("mse_loss", F.mse_loss, (torch.randn(8), torch.randn(8)), {}),
    ("linear", F.linear, (torch.randn(2, 4), torch.randn(3, 4)), {}),
    ("conv2d", F.conv2d, (torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)), {}),
    ("cat", torch.cat, ([torch.randn(2, 2), torch.randn(2, 2)],), {}),
    ("mul", torch.mul, (torch.randn(2), torch.randn(2)), {}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,func,args,kwargs", CASES, ids=[c[0] for c in CASES])
def test_the_probe_agrees_with_autocast_on_real_tensors(name, func, args, kwargs, dtype):
    half = [a.to(dtype) if isinstance(a, torch.Tensor) else [t.to(dtype) for t in a] if isinstance(a, list) else a
            for a in args]
    with torch.autocast("cpu", dtype=dtype):
        real = func(*half, **kwargs)
        asked = runs_in_fp32(func, tuple(half), kwargs, "cpu", dtype)
    assert asked == (real.dtype == torch.float32), (name, real.dtype)


def test_a_call_the_probe_cannot_make_is_not_fp32():
    def no_fake_kernel(t):
        return torch.tensor(t.tolist())  # reads data: impossible on fake tensors

    assert runs_in_fp32(no_fake_kernel, (torch.randn(3),), {}, "cpu", torch.bfloat16) is False


def test_the_answer_is_kept_per_op_and_device():
    from aiak.amp import autocast_policy

    runs_in_fp32(torch.cdist, (torch.randn(3, 4), torch.randn(5, 4)), {}, "cpu", torch.bfloat16)
    assert autocast_policy._known[(torch.cdist, "cpu", torch.bfloat16)] is True
