"""Runs the window-attention Triton kernels under TRITON_INTERPRET=1 and prints their errors as JSON.

Started as a subprocess by test_window_attention_triton.py so the interpreter flag (read by triton when
the kernels are decorated) never leaks into the rest of the pytest session. For each case it prints the
max abs error against a float64 reference of the kernel and of the same-dtype torch formula, for the
output and for the gradients of q, k, v and bias. Before any case it repairs the interpreter's bf16 dot and
fp32 -> bf16 cast (triton_interpreter_bf16.py, which says why) and prints the probe before and after.
"""
import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton_interpreter_bf16  # noqa: E402  (beside this file, which runs as a script)

from aiak.ops.window_attention import reference_window_attention, window_attention  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _inputs(case, gen):
    windows, heads, n, d, nw = case["windows"], case["heads"], case["n"], case["d"], case["nw"]
    dtype = DTYPES[case["dtype"]]
    q, k, v = (torch.randn(windows, heads, n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    if case.get("hf_layout"):  # q/k/v as produced by Hugging Face: [W, N, H, D].transpose(1, 2)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    bias = torch.randn(heads, n, n, generator=gen, dtype=torch.float64) if case["bias"] else None
    if case.get("hf_layout") and bias is not None:  # table[index].view(N, N, H).permute(2, 0, 1): H innermost
        bias = bias.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    mask = None
    if nw:
        keep = torch.rand(nw, n, n, generator=gen) > 0.3
        keep |= torch.eye(n, dtype=torch.bool)  # every row keeps at least its own token, as in Swin
        mask = torch.where(keep, 0.0, -100.0).to(torch.float64)
    return q, k, v, bias, mask, dtype


def _run(fn, q, k, v, bias, mask, grad, dtype, bias_grad):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # .to keeps the strides
    b = None
    if bias is not None:
        b = bias.detach().to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_(bias_grad)
    m = None if mask is None else mask.to(dtype)
    out = fn(*leaves, b, m)
    wrt = leaves + ([b] if b is not None and bias_grad else [])
    grads = torch.autograd.grad(out, wrt, grad.to(out.dtype))
    return [out] + list(grads)


def run_case(case):
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    q, k, v, bias, mask, dtype = _inputs(case, gen)
    grad = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    if case.get("hf_layout"):  # the incoming gradient of out.transpose(1, 2).reshape(...) is token-major too
        grad = grad.transpose(1, 2).contiguous().transpose(1, 2)
    bias_grad = case.get("bias_grad", True)
    ref = _run(reference_window_attention, q, k, v, bias, mask, grad, torch.float64, bias_grad)
    torch_same = _run(reference_window_attention, q, k, v, bias, mask, grad, dtype, bias_grad)
    start = time.perf_counter()
    kernel = _run(lambda *a: window_attention(*a, backend="triton"), q, k, v, bias, mask, grad, dtype, bias_grad)
    seconds = time.perf_counter() - start
    names = ["out", "dq", "dk", "dv", "dbias"][:len(ref)]

    def err(a, b):
        return (a.double() - b).abs().max().item()

    return {
        "id": case["id"],
        "seconds": seconds,
        "kernel_err": {n: err(a, r) for n, a, r in zip(names, kernel, ref)},
        "torch_err": {n: err(a, r) for n, a, r in zip(names, torch_same, ref)},
        "ref_scale": {n: r.abs().max().item() for n, r in zip(names, ref)},
        "kernel_dtypes": {n: str(a.dtype) for n, a in zip(names, kernel)},
        # out is laid out [B*nW, N, H, D] so that out.transpose(1, 2).reshape(B*nW, N, C) needs no copy
        "out_token_major": kernel[0].transpose(1, 2).is_contiguous(),
    }


def main():
    cases = json.loads(sys.argv[1])
    print("INTERPRETER_BF16 " + json.dumps(triton_interpreter_bf16.patch()))
    results = []
    for case in cases:
        try:
            results.append(run_case(case))
        except Exception as exc:  # reported per case, so one failure does not hide the others
            results.append({"id": case["id"], "error": f"{type(exc).__name__}: {exc}"})
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
