"""Shared machinery of the layer-wise optimizers (LAMB, LARS): bucketing, fp32 state, validation.

Layer-wise optimizers need one norm per parameter *before* they can update it, so a plain
``torch._foreach_*`` sweep over every tensor of the model would run each elementwise op over the whole
model (hundreds of MB on a ResNet-50) and stream every temporary through DRAM. Here the multi-tensor
path works on **buckets** of at most ``bucket_elems`` elements instead (the idea of apex's
``multi_tensor_apply`` chunks, applied on the host side): whole small tensors are packed together, and a
tensor larger than a bucket is cut into flat pieces. A bucket's temporaries then stay in cache, and a
whole tensor is updated right after its norms are known. Temporaries live in scratch memory kept
between steps (`BucketPlan`), so the hot loop allocates nothing. Pieces of a cut tensor need
the norm of the whole tensor, so they take two sweeps: the first accumulates the piece norms, the
second updates with the finished trust ratio.

On CUDA the default is one bucket per (device, dtype) group: every foreach op is then one or a few
kernel launches over all tensors, which is what makes foreach fast there.
"""
from __future__ import annotations

import importlib.util
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

from aiak.amp.half_compute import HALF_DTYPES
from aiak.optim.sharded import FullSquares, any_sharded, local, squares
from aiak.util.warn import warn_once

# A bucket is a list of (tensor index, start, stop) in flat element coordinates; (i, 0, numel) is whole.
Piece = Tuple[int, int, int]

# CPU default: 1 Mi elements per bucket. A bucket's ~6 live fp32 arrays (24 MB) then stay in a server
# L3, and ops stay large enough to split across threads (benchmarks/optimizers.py --bucket-elems: on
# the 2-core EPYC here 256 Ki - 1 Mi were equal within noise, whole-list foreach ~2x slower).
DEFAULT_CPU_BUCKET_ELEMS = 1 << 20


def default_bucket_elems(device: torch.device) -> Optional[int]:
    """Bucket size used when the optimizer is given ``bucket_elems=None``: cache-sized on CPU, unbounded on GPU."""
    return DEFAULT_CPU_BUCKET_ELEMS if device.type == "cpu" else None


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_elems: Optional[int], *extra: Sequence[torch.Tensor]
                 ) -> Tuple[List[List[Piece]], List[bool]]:
    """Split ``tensors`` into buckets of at most ``bucket_elems`` elements.

    A tensor is cut into flat pieces only when it is larger than a bucket and it and its companions in
    ``extra`` (grads, state) are all contiguous, so the same flat slice means the same elements in each.
    Returns the buckets and, per tensor, whether it was cut.
    """
    cut = [False] * len(tensors)
    if bucket_elems is None:
        return [[(i, 0, t.numel()) for i, t in enumerate(tensors)]], cut
    buckets: List[List[Piece]] = []
    current: List[Piece] = []
    filled = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if n > bucket_elems and t.is_contiguous() and all(e[i].is_contiguous() for e in extra):
            cut[i] = True
            for start in range(0, n, bucket_elems):
                buckets.append([(i, start, min(n, start + bucket_elems))])
            continue
        if current and filled + n > bucket_elems:
            buckets.append(current)
            current, filled = [], 0
        current.append((i, 0, n))
        filled += n
    if current:
        buckets.append(current)
    return buckets, cut


def take(tensors: Sequence[torch.Tensor], bucket: Sequence[Piece], cut: Sequence[bool]) -> List[torch.Tensor]:
    """The views of ``tensors`` that ``bucket`` covers (whole tensors, or flat slices of cut ones)."""
    return [tensors[i].view(-1)[start:stop] if cut[i] else tensors[i] for i, start, stop in bucket]


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the update is computed (and state kept) in: fp32 for half/bfloat16, else the dtype itself."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


class BucketPlan:
    """The buckets of one list of parameters, with views and scratch memory cached between steps.

    ``persistent`` are lists that live across steps (parameters, then their state tensors): their bucket
    views are built once. Gradients may be new tensors every step and are cut per call (`take`).
    Scratch (`scratch`) is one flat buffer per slot, sized to the largest bucket, so the hot loop
    allocates nothing; with ``bucket_elems=None`` (one bucket, GPU) it is allocated per call instead and
    the caching allocator serves it.
    """

    def __init__(self, persistent: Sequence[Sequence[torch.Tensor]], bucket_elems: Optional[int]):
        self.buckets, self.cut = plan_buckets(persistent[0], bucket_elems, *persistent[1:])
        self.views = [[take(t, b, self.cut) for t in persistent] for b in self.buckets]
        self.cached_scratch = bucket_elems is not None
        self._fusable: Dict[int, bool] = {}
        self._flat: Dict[tuple, torch.Tensor] = {}
        self._scratch: Dict[tuple, List[torch.Tensor]] = {}
        # buckets holding the pieces of each cut tensor, in order
        self.pieces_of: Dict[int, List[int]] = {}
        for k, bucket in enumerate(self.buckets):
            if self.cut[bucket[0][0]]:
                self.pieces_of.setdefault(bucket[0][0], []).append(k)

    def is_last_piece(self, k: int) -> bool:
        """Bucket ``k`` is the last piece of a cut tensor (its whole-tensor norms are complete after it)."""
        return self.pieces_of[self.buckets[k][0][0]][-1] == k

    def whole_tensor_scratch(self, k: int, dtype: torch.dtype) -> List[torch.Tensor]:
        """For a piece of a cut tensor: its slice of a buffer as large as the largest cut tensor.

        Lets an update computed piece by piece wait, in cache, for the norm of the whole tensor.
        """
        i, start, stop = self.buckets[k][0]
        key = ("whole", dtype)
        if key not in self._flat:
            largest = max(self.buckets[ks[-1]][0][2] for ks in self.pieces_of.values())  # stop of a last piece
            self._flat[key] = torch.empty(largest, device=self.views[k][0][0].device, dtype=dtype)
        return [self._flat[key][start:stop]]

    def fusable(self, k: int, grads: Sequence[torch.Tensor]) -> bool:
        """Bucket ``k``'s tensors, their state and ``grads`` share one dense layout each (`same_layout`).

        The parameters' and state's part is checked once per plan; the gradients, which may be new
        tensors every step, on every call.
        """
        if k not in self._fusable:
            self._fusable[k] = same_layout(*self.views[k])
        return self._fusable[k] and all(g.stride() == p.stride() for g, p in zip(grads, self.views[k][0]))

    def take(self, k: int, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Bucket ``k`` of ``grads``; a non-contiguous gradient of a cut parameter is read in logical order."""
        return [grads[i].reshape(-1)[start:stop] if self.cut[i] else grads[i] for i, start, stop in self.buckets[k]]

    def scratch(self, k: int, slot: int, dtype: torch.dtype) -> List[torch.Tensor]:
        """Uninitialised tensors shaped like bucket ``k``'s parameter views (``slot`` names the temporary)."""
        like = self.views[k][0]
        if not self.cached_scratch:
            return [torch.empty_strided(t.shape, dense_strides(t), device=t.device, dtype=dtype) for t in like]
        views = self._scratch.get((k, slot, dtype))
        if views is None:
            key = (slot, dtype)
            if key not in self._flat:
                largest = max(sum(t.numel() for t in v[0]) for v in self.views)
                self._flat[key] = torch.empty(largest, device=like[0].device, dtype=dtype)
            sizes = [t.numel() for t in like]
            pieces = torch.split(self._flat[key][:sum(sizes)], sizes)
            views = self._scratch[(k, slot, dtype)] = [p.as_strided(t.shape, dense_strides(t))
                                                       for p, t in zip(pieces, like)]
        return views


def dense_strides(t: torch.Tensor) -> Tuple[int, ...]:
    """``t``'s strides if it covers its memory without gaps or overlap (contiguous, channels_last or any other
    permutation of dimensions), else contiguous strides: the layout to give a scratch tensor shaped like ``t``.

    A scratch tensor with the parameter's own layout can then go through a fused kernel beside the
    parameter's gradient and state, which walk memory in the same order (see `same_layout`).
    """
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return contiguous_strides(t.shape)
        expected *= size
    return t.stride()


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Row-major strides of ``shape`` (what ``torch.empty(shape).stride()`` gives, without allocating)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def same_layout(*lists: Sequence[torch.Tensor]) -> bool:
    """Each tensor of the first list, and its peers at the same index in the others, share one dense layout.

    What a fused multi-tensor kernel that walks raw memory needs (torch's CPU ``_fused_adam_`` silently
    pairs the wrong elements otherwise: a channels_last gradient beside contiguous moments, for example).
    """
    for peers in zip(*lists):
        first = peers[0]
        stride = first.stride()
        dense = first.is_contiguous() or (first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last)) \
            or dense_strides(first) == stride   # (the two common layouts without sorting the strides: every step)
        if not dense or any(t.stride() != stride for t in peers[1:]):
            return False
    return True


class PlanCache:
    """The optimizer's `BucketPlan` per list of tensors, rebuilt when any tensor was replaced.

    Plans not used during a step are dropped by `prune` (their views would otherwise keep replaced
    parameters or state alive).
    """

    def __init__(self) -> None:
        self._plans: Dict[tuple, BucketPlan] = {}
        self._used: set = set()

    def get(self, persistent: Sequence[Sequence[torch.Tensor]], bucket_elems: Optional[int]) -> BucketPlan:
        # the cached views keep their tensors alive, so an id in the key cannot be reused by another tensor
        key = (bucket_elems, tuple(id(t) for ts in persistent for t in ts))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = BucketPlan(persistent, bucket_elems)
        self._used.add(key)
        return plan

    def prune(self) -> None:
        for key in [k for k in self._plans if k not in self._used]:
            del self._plans[key]
        self._used = set()


def cached_plan(cache: Optional[PlanCache], persistent: Sequence[Sequence[torch.Tensor]],
                bucket_elems: Optional[int]) -> BucketPlan:
    """``cache.get(...)``, or a throw-away plan without a cache (functional use)."""
    return BucketPlan(persistent, bucket_elems) if cache is None else cache.get(persistent, bucket_elems)


def working_copies(plan, k, p, g, grad_scale):
    """Bucket ``k``'s weights and gradients in the math dtype: fp32 copies of half tensors, scaled gradients."""
    dtype = math_dtype(p[0].dtype)
    w = p
    if dtype != p[0].dtype:
        w = plan.scratch(k, 2, dtype)
        torch._foreach_copy_(w, p)
    if g is not None and (g[0].dtype != dtype or grad_scale != 1.0):
        g32 = plan.scratch(k, 3, dtype)
        torch._foreach_copy_(g32, g)
        if grad_scale != 1.0:
            torch._foreach_mul_(g32, grad_scale)
        g = g32
    return w, g


def write_back(params: List[torch.Tensor], fp32_copies: List[torch.Tensor]) -> None:
    """Copy fp32 working copies back into half/bfloat16 parameters (no-op for fp32 parameters)."""
    pairs = [(p, w) for p, w in zip(params, fp32_copies) if p is not w]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [w for _, w in pairs])


def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, as one 1-D tensor.

    On CPU the squares are BLAS dot products of the flat tensors: ``linalg.vector_norm``'s CPU kernel
    ran single-threaded and ~1.4x slower than ``dot`` here (1 Mi fp32 elements: 111 us vs 78 us on one
    thread, 43 us on two). Elsewhere ``torch._foreach_norm`` (a single multi-tensor kernel).
    """
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(list(tensors)))
    squares = [torch.dot(t.view(-1), t.view(-1)) if t.is_contiguous() else torch.linalg.vector_norm(t).square()
               for t in tensors]
    return torch.stack(squares).sqrt()


# Tests set this to run the accelerator form of per-tensor scalars (host floats) on the CPU.
FORCE_HOST_SCALARS = False


def per_tensor_scalars(values: torch.Tensor, via_host: Optional[bool] = None) -> list:
    """One scalar per tensor for a foreach op, from a 1-D tensor of ``values``.

    On CPU: 0-dim tensors (no copy). Elsewhere the values go to the host once (one sync per call) and
    come back as Python floats, which keeps foreach on its fused multi-tensor kernels (a list of 0-dim
    device tensors sends it down the per-tensor slow path). ``via_host`` forces either form.
    """
    if via_host is None:
        via_host = FORCE_HOST_SCALARS or values.device.type != "cpu"
    return values.tolist() if via_host else list(values.unbind())


def add_scaled_(targets: List[torch.Tensor], sources: List[torch.Tensor], scales: torch.Tensor, alpha: float,
                via_host: Optional[bool] = None) -> None:
    """``targets[i] += alpha * scales[i] * sources[i]`` (``scales``: 1-D, one value per tensor).

    On CPU one ``addcmul_`` pass with 0-dim scales; elsewhere see `per_tensor_scalars`.
    """
    if via_host is None:
        via_host = FORCE_HOST_SCALARS or scales.device.type != "cpu"
    if via_host:
        torch._foreach_add_(targets, torch._foreach_mul(sources, (scales * alpha).tolist()))
    else:
        torch._foreach_addcmul_(targets, sources, list(scales.unbind()), alpha)


def group_by_device_dtype_step(params: List[torch.Tensor], steps: List[int]) -> Dict[tuple, List[int]]:
    """Indices of ``params`` grouped by (device, dtype, step): tensors of one group share every scalar."""
    groups: Dict[tuple, List[int]] = {}
    for i, (p, s) in enumerate(zip(params, steps)):
        groups.setdefault((p.device, p.dtype, s), []).append(i)
    return groups


def global_grad_norm(param_groups: Iterable[dict]) -> Optional[torch.Tensor]:
    """fp32 L2 norm of every gradient of every group (one number, as apex's ``max_grad_norm`` uses)."""
    with_grads = [p for g in param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad for p in with_grads]
    if not grads:
        return None
    if any_sharded(grads):  # DTensor gradients: their local shards' squares summed over the shards
        return FullSquares(with_grads)(squares([local(g) for g in grads])).sum().sqrt().cpu()
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    per_device = []
    for device_grads in by_device.values():
        norms = torch._foreach_norm(device_grads, 2.0, dtype=torch.float32)
        per_device.append(torch.stack(norms).square().sum().cpu())
    return torch.stack(per_device).sum().sqrt()


def clip_coefficient(param_groups: Iterable[dict], max_grad_norm: Optional[float]) -> float:
    """``min(1, max_grad_norm / ||g||)`` over all gradients, or 1.0 when clipping is off."""
    if not max_grad_norm:
        return 1.0
    norm = global_grad_norm(param_groups)
    if norm is None:
        return 1.0
    norm = float(norm)
    if not math.isfinite(norm):
        return 1.0  # leave inf/nan gradients alone: the loss scaler skips such steps
    return max_grad_norm / norm if norm > max_grad_norm else 1.0


def check_range(name: str, value, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Raise one ValueError naming the hyper-parameter and the valid interval."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")


def check_betas(betas) -> Tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2) with each in [0, 1), got {betas!r}")
    check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    check_range("betas[1]", betas[1], 0.0, 1.0, high_open=True)
    return float(betas[0]), float(betas[1])


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_unfit(tensors: Sequence[torch.Tensor], *companions: Optional[Sequence[torch.Tensor]]) -> str:
    """Why the Triton kernels of `aiak.optim._triton.layerwise` cannot step ``tensors`` (parameters) with their
    ``companions`` (gradients, state: lists in the same order, or None), or "": they need CUDA tensors (CPU ones
    run only under ``TRITON_INTERPRET=1``, the tests' interpreter), fp32, fp16 or bf16, each gradient and state in
    its parameter's layout (`same_layout`), triton installed, and no ``torch.compile`` tracing the step (it compiles
    the torch path)."""
    if torch.compiler.is_compiling():
        return "torch.compile traces the step"
    device = tensors[0].device
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type != "cuda" and not (interpret and device.type == "cpu"):
        return f"the parameters are on {device.type}, and the kernels run on CUDA"
    for t in tensors:   # (one pass: this runs at every step)
        if t.device != device:
            return "the parameters of one group are on several devices"
        if t.dtype not in TRITON_DTYPES:
            return "the kernels cover fp32, fp16 and bf16 parameters"
    if not same_layout(tensors, *(c for c in companions if c is not None)):
        return "a gradient or state tensor is not laid out as its parameter (or not dense)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'aiak[triton]')"
    return ""


class LayerwiseOptimizer(Optimizer):
    """Base of `Lamb` and `Lars`: fp32 state kept fp32 on reload.

    ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype; for half
    parameters that would silently turn the fp32 moments into fp16. This restores them in fp32.
    """

    _fp32_state_keys: Tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, bucket_elems: Optional[int], fused: Optional[bool]):
        if bucket_elems is not None and (not isinstance(bucket_elems, int) or bucket_elems < 0):
            raise ValueError(f"bucket_elems must be None (automatic), 0 (one bucket) or a positive int, "
                             f"got {bucket_elems!r}")
        self._check_group(defaults)
        super().__init__(params, defaults)  # calls add_param_group, which checks every group
        self.bucket_elems = bucket_elems
        self.fused = fused
        self._plans = PlanCache()

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    @staticmethod
    def _check_group(group: dict) -> None:
        """Validate one param group's hyper-parameters (subclasses say which)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        for group, saved_group in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], saved_group["params"]):
                if pid not in saved_state or p.dtype not in HALF_DTYPES:
                    continue
                for key in self._fp32_state_keys:
                    value = saved_state[pid].get(key)
                    if isinstance(value, torch.Tensor):
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def _bucketing(self) -> Tuple[Optional[int], Optional[PlanCache]]:
        """``(bucket_elems, plan cache)`` for this step.

        Under ``torch.compile`` the step runs as one bucket without cached scratch: the eager path writes its
        temporaries with ``out=`` into views of a flat scratch buffer, a "mutation on a view chain" that
        dynamo refuses (``torch.compile(Lamb.step, backend="aot_eager")`` failed at the first ``torch.mul(...,
        out=...)``), and a compiled graph plans its own temporaries. Same maths, so the same result within
        fp32 rounding (tests/optim/test_compile_step.py).
        """
        if torch.compiler.is_compiling():
            return 0, None
        return self.bucket_elems, self._plans

    def _runs_triton(self, group: dict, params: List[torch.Tensor], *companions: Optional[List[torch.Tensor]]
                     ) -> bool:
        """Whether a group's step runs the Triton kernels (`triton_unfit`): by default (``fused=None``) where they
        can, unless the group asks for the single-tensor loop (``foreach=False``); with ``fused=True`` too (where
        they cannot, it warns once and the torch path runs: the same maths); never with ``fused=False``."""
        if self.fused is False or (self.fused is None and (group["foreach"] is False
                                                           or any(p.device.type != "cuda" for p in params))):
            return False
        why = triton_unfit(params, *companions)
        if why and self.fused:
            warn_once(f"{type(self).__name__}-fused-{why}",
                      f"aiak: {type(self).__name__}(fused=True): {why}; the multi-tensor torch path steps instead "
                      f"(the same maths; fused=None chooses the kernels wherever they run)")
        return not why

    def _sharded(self) -> bool:
        """DTensor parameters (FSDP2, tensor parallelism): the step runs on local shards (`aiak.optim.sharded`).
        Looked at again only when the groups change (a group added, or FSDP2's shards swapped in: a new list)."""
        groups = tuple((id(g["params"]), len(g["params"])) for g in self.param_groups)
        if getattr(self, "_sharded_for", None) != groups:
            self._sharded_for = groups
            self._sharded_params = any_sharded([p for g in self.param_groups for p in g["params"]])
        return self._sharded_params

    def _begin_step(self, closure):
        """What every ``step`` starts with: evaluate the closure (with grad) and refuse sparse gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_dense_grads()
        return loss

    def _check_dense_grads(self) -> None:
        """Refuse sparse gradients before anything is modified (layer-wise norms need dense tensors)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use a dense "
                                       f"embedding (sparse=False) or torch.optim.SparseAdam for those parameters")

    def _gather(self, group: dict, state_keys: Sequence[str]):
        """Params with a gradient, their grads and state; initialises state on first use."""
        params, grads, step_counts = [], [], []
        states: Dict[str, List[torch.Tensor]] = {k: [] for k in state_keys}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                self._init_state(p, state)
            params.append(p)
            grads.append(p.grad)
            step_counts.append(state["step"])
            for k in state_keys:
                states[k].append(state.get(k))
        steps: List[int] = []
        if step_counts:  # one increment and one read for the whole group, not two small ops per tensor
            torch._foreach_add_(step_counts, 1.0)
            steps = [int(s) for s in torch.stack(step_counts).tolist()]
        return params, grads, steps, states

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError
