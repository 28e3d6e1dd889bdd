"""One rank of ``tests/comm/test_sharded.py``: ``aiak.optimize`` on a model the script sharded with FSDP2
(``fully_shard``), each case against one process training the same model on every rank's batches (the global batch),
launched as torchrun would by ``tests/comm/conftest.launch``."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.comm.dist_worker import CollectiveRecorder, main  # noqa: E402

STEPS = 3
ITEMS = (8, 2, 5, 3)  # a rank's batch under counted items (unequal); else 4 rows each
CASES = {
    # name: (strategy beyond tune: false, optimizer, accumulation micro-batches per step, clip, counted items)
    "default": ({}, "adamw", 1, None, False),
    "o1_bf16": ({"precision": {"level": "O1", "dtype": "bf16"}}, "sgd", 1, None, False),
    "accumulation": ({"grad_accumulation": 4}, "adamw", 4, None, False),
    "counted": ({"grad_accumulation": 2}, "sgd", 2, None, True),
    "clipping": ({"grad_accumulation": 2}, "sgd", 2, 0.05, False),
    "lamb": ({"optimizer": {"name": "lamb", "lr": 0.02, "weight_decay": 0.01}}, "sgd", 1, None, False),
    "lamb_loop": ({"optimizer": {"name": "lamb", "lr": 0.02, "weight_decay": 0.01, "foreach": False,
                                 "max_grad_norm": 0.5}, "grad_accumulation": 2}, "sgd", 2, None, False),
    "lars": ({"optimizer": {"name": "lars", "lr": 0.5, "weight_decay": 1e-4}}, "sgd", 1, None, False),
    "lars_loop": ({"optimizer": {"name": "lars", "lr": 0.5, "weight_decay": 1e-4, "foreach": False,
                                 "momentum": 0.9, "nesterov": True, "clip": True}}, "sgd", 1, None, False),
    # bucket_elems: the bucketed path's setting (tensors cut into 64-element pieces) on even and uneven shards
    "lamb_even": ({"optimizer": {"name": "lamb", "lr": 0.02, "weight_decay": 0.01, "bucket_elems": 64}}, "sgd", 1,
                  None, False),
    "lars_buckets": ({"optimizer": {"name": "lars", "lr": 0.5, "weight_decay": 1e-4, "bucket_elems": 64}}, "sgd", 1,
                     None, False),
    # fused: LAMB's and LARS's Triton kernels, run by the interpreter (the launch sets TRITON_INTERPRET=1)
    "lamb_triton": ({"optimizer": {"name": "lamb", "lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 0.5}}, "sgd",
                    1, None, False),
    "lars_triton": ({"optimizer": {"name": "lars", "lr": 0.5, "weight_decay": 1e-4, "momentum": 0.9,
                                   "nesterov": True, "clip": True}}, "sgd", 1, None, False),
}
FUSED = ("lamb_triton", "lars_triton")
SIZES = {"lamb_even": (32, 8)}  # (hidden, out) of a case's model: 32 and 8 rows shard evenly over 2 and 4 ranks
SCHEDULED = ("accumulation",)   # cases with a StepLR (halving the rate at each real step), stepped at each step()


def _model(hidden=31, out=7):
    """Odd sizes by default: 31 and 7 rows shard unevenly over 2 and 4 ranks (8, 8, 8, 7 and 2, 2, 2, 1 on 4)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, hidden), nn.Tanh(), nn.Linear(hidden, out))


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _optimizer(name, params):
    return torch.optim.AdamW(params, lr=0.01) if name == "adamw" else torch.optim.SGD(params, lr=0.1)


def _batch(rank, step, micro, counted, out=7):
    n = ITEMS[rank] if counted else 4
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(n, 13, generator=g), torch.randn(n, out, generator=g)


def _items_loss(out, y):
    """A mean over the batch's items (rows)."""
    return nn.functional.mse_loss(out, y, reduction="none").sum(1).mean()


def _reference(spec, world, sizes=(31, 7), scheduled=False):
    """One process over every rank's batches: each step's loss a mean over all its items (equal micro-batches: the
    mean of their means), the aiak optimizer the strategy names (LAMB/LARS) as the plain model would get it."""
    from aiak.optim import swap_optimizer
    from aiak.strategy.profiles import load_strategy

    strategy, opt_name, micro, clip, counted = spec
    model = _model(*sizes)
    opt = swap_optimizer(model, _optimizer(opt_name, model.parameters()), load_strategy(strategy).optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduled else None
    half = strategy.get("precision", {}).get("level") == "O1"
    for step in range(STEPS):
        batches = [_batch(r, step, k, counted, sizes[1]) for k in range(micro) for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        with torch.autocast("cpu", torch.bfloat16, enabled=half):
            out = model(x)
        _items_loss(out.float(), y).backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def scenario_cases(rank):
    """Every case of `CASES`, then aiak's own FSDP2 on real models (`engine`), in one launch (a process's start is
    most of a case's time)."""
    return {**{case: _run_case(rank, case) for case in CASES}, "engine": engine(rank)}


def _run_case(rank, case):
    """``case`` through ``aiak.optimize`` on the FSDP2 model, with the reduce-scatters of each backward and the
    all-reduces of each ``optimizer.step()`` counted. Returns the full weights of both runs and the counts."""
    import aiak

    strategy, opt_name, micro, clip, counted = CASES[case]
    model = _shard(_model(*SIZES.get(case, (31, 7))))
    opt = _optimizer(opt_name, model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case in SCHEDULED else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, **strategy},
                                      count_items=True if counted else None)
    first_passes, counted_passes = [], {}   # the Triton kernels' first passes (FUSED), counted
    if case in FUSED:
        from aiak.optim._triton import layerwise

        opt.fused = True   # the kernels: on CPU only under the interpreter, where fused=None keeps the torch path
        for name in ("lamb_moments", "lars_squares"):
            counted_passes[name] = real = getattr(layerwise, name)
            setattr(layerwise, name, lambda *a, _real=real, **k: first_passes.append(1) or _real(*a, **k))
    reduce_scatters, step_all_reduces = [], []
    for step in range(STEPS):
        for k in range(micro):
            x, y = _batch(rank, step, k, counted, SIZES.get(case, (31, 7))[1])
            if counted:
                aiak.count_items(opt, len(x))
            with CollectiveRecorder() as calls:
                _items_loss(model(x).float(), y).backward()
            reduce_scatters.append(sum(1 for op, *_ in calls.calls if op.startswith("reduce_scatter")))
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            with CollectiveRecorder() as calls:
                opt.step()
            step_all_reduces.append(sum(1 for op, *_ in calls.calls if op == "all_reduce"))
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()  # (at every step() call, as a script does; aiak counts the real steps)
    if counted_passes:
        from aiak.optim._triton import layerwise

        for name, real in counted_passes.items():
            setattr(layerwise, name, real)
    reference = _reference(CASES[case], dist.get_world_size(), SIZES.get(case, (31, 7)), case in SCHEDULED)
    return {"weights": [p.full_tensor().detach().clone() for p in model.parameters()], "reference": reference,
            "reduce_scatters": reduce_scatters, "step_all_reduces": step_all_reduces, "micro": micro,
            "first_passes": len(first_passes)}


REFUSED = {
    "O2": {"precision": {"level": "O2", "dtype": "bf16"}},
    "fp16": {"precision": {"level": "O1", "dtype": "fp16"}},
    "channels_last": {"channels_last": True},
    "fused_ops": {"fused_ops": ["window_attention"]},
    "comm": {"comm": {"algorithm": "local_sgd", "compression": "fp16"}},
    "tune": {"tune": True},
}


def scenario_two_ranks(rank):
    """The checks of one launch on 2 ranks, one after the other."""
    return {"refusals": refusals(), "auto": auto(rank), "script_accumulates": script_accumulates(rank),
            "sharded_after": sharded_after(rank), "engine_o2": engine_o2(rank),
            "tensor_parallel": tensor_parallel(rank)}


def tensor_parallel(rank):
    """Tensor parallelism (``parallelize_module``: the first layer column-wise, the last row-wise) over both ranks,
    then ``aiak.optimize`` with accumulation 2: no DDP, every rank trains on the same batches, against one process."""
    import aiak
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def even():  # (tensor parallelism splits the hidden width evenly: 32 columns)
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(13, 32), nn.Tanh(), nn.Linear(32, 7))

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(even(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "grad_accumulation": 2})
    for step in range(STEPS):
        for micro in range(2):
            x, y = _batch(0, step, micro, False)  # (the same batch on every rank)
            _items_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    reference = even()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        batches = [_batch(0, step, micro, False) for micro in range(2)]
        _items_loss(reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"weights": [p.full_tensor().detach().clone() for p in model.parameters()],
            "reference": [p.detach().clone() for p in reference.parameters()],
            "is_ddp": isinstance(model, nn.parallel.DistributedDataParallel)}


def engine_o2(rank):
    """``comm.engine: fsdp2`` with precision O2 bf16 on the HF GPT-2: the dtype a block's linear layer computes with,
    the sharded parameters' dtype, the weights after two steps against fp32 in one process, and how far they
    moved."""
    import aiak

    world = dist.get_world_size()
    model, opt = _optimizer_with_state(_gpt2, _lm_batch, _lm_loss, world)
    start = [p.detach().clone() for p in model.parameters()]
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "precision": {"level": "O2", "dtype": "bf16"},
                                                        "comm": {"engine": "fsdp2"}})
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    for step in range(2):
        _lm_loss(model, _lm_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    reference, ref_opt = _optimizer_with_state(_gpt2, _lm_batch, _lm_loss, world)
    for step in range(2):
        _lm_loss(reference, torch.cat([_lm_batch(r, step) for r in range(world)])).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    weights = [p.full_tensor().detach().clone() for p in model.parameters()]
    return {"computed_in": seen, "sharded_dtypes": {p.dtype for p in model.parameters()},
            "from_fp32": max((a - b).abs().max().item() for a, b in zip(weights, reference.parameters())),
            "moved": max((a - b).abs().max().item() for a, b in zip(weights, start)),
            "effects": dict((knob, effect) for knob, _, effect in aiak.last_decision().effects)}


def sharded_after(rank):
    """``aiak.optimize`` (aiak's DDP), then ``fully_shard`` on the model inside it, then a step: its error."""
    import aiak

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "grad_accumulation": 2})
    inner = _shard(model.module)
    try:
        for micro in range(2):
            x, y = _batch(rank, 0, micro, False)
            _items_loss(inner(x), y).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return str(e)
    return None


def script_accumulates(rank):
    """The script's own accumulation (two backward passes per ``step()``) beside aiak's ``grad_accumulation: 2`` on
    the FSDP2 model: the error of the first ``step()``, if any."""
    import aiak

    model = _shard(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = aiak.optimize(model, opt, strategy={"tune": False, "grad_accumulation": 2})
    for micro in range(2):
        x, y = _batch(rank, 0, micro, False)
        _items_loss(model(x), y).backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def refusals():
    """Each strategy of `REFUSED` on the FSDP2 model: the error ``optimize()`` raises, and whether the model and
    optimizer came back untouched (the same parameters, no hooks, the optimizer's own ``step``)."""
    import aiak

    model = _shard(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params, step, hooks = list(model.parameters()), opt.step, len(model._forward_hooks)
    out = {}
    for name, strategy in REFUSED.items():
        try:
            aiak.optimize(model, opt, strategy={"tune": False, **strategy})
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test reads the type and the message
            out[name] = (type(e).__name__, str(e))
    out["untouched"] = (all(a is b for a, b in zip(params, model.parameters())) and opt.step == step
                        and len(model._forward_hooks) == hooks)
    return out


def auto(rank):
    """``strategy="auto"`` on the FSDP2 model with a loader: what it applied, its knobs' reasons, its warnings, and
    whether it trains as one process does."""
    import aiak

    model = _shard(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_batch(rank, step, 0, False) for step in range(STEPS)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, loader = aiak.optimize(model, opt, batches)
    decision = aiak.last_decision()
    for x, y in loader:
        _items_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    precision = {"precision": {"level": decision.strategy["precision"]["level"], "dtype": "bf16"}}
    return {"strategy": decision.strategy, "tuning": decision.tuning, "warnings": [str(w.message) for w in caught],
            "is_ddp": isinstance(model, nn.parallel.DistributedDataParallel),
            "weights": [p.full_tensor().detach().clone() for p in model.parameters()],
            "reference": _reference((precision, "sgd", 1, None, False), dist.get_world_size())}


# -- aiak shards the model itself: comm.engine fsdp2 --------------------------------------------------------------
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                        max_position_embeddings=32))


def _vit():
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=5)


def _lm_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 97, (2, 12), generator=g)


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _image_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 5, (2,), generator=g)


def _image_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


ENGINE_MODELS = {"gpt2": (_gpt2, _lm_batch, _lm_loss), "llama": (_llama, _lm_batch, _lm_loss),
                 "vit": (_vit, _image_batch, _image_loss)}


def _concat(batches):
    if isinstance(batches[0], torch.Tensor):
        return torch.cat(batches)
    return tuple(torch.cat(parts) for parts in zip(*batches))


def _optimizer_with_state(make, batch, loss_of, world):
    """The model and its SGD with momentum after one step on the global batch (the same on every rank): an
    optimizer with state before ``aiak.optimize``, as a resumed script has."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_of(model, _concat([batch(r, 99) for r in range(world)])).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def engine(rank):
    """``comm.engine: fsdp2`` on an HF GPT-2, an HF Llama and a timm ViT (SGD with momentum state from a step before,
    2 steps of accumulation 2; ``optimizer.fused`` asked for, which stays off on the shards): aiak shards each and the script's optimizer, its state re-pointed, trains the shards.
    Against one process over the global batch; with what aiak says it did, each rank's share of the parameters and
    of the optimizer's state, and whether the objects returned are the script's."""
    import aiak

    world, out = dist.get_world_size(), {}
    for name, (make, batch, loss_of) in ENGINE_MODELS.items():
        model, opt = _optimizer_with_state(make, batch, loss_of, world)
        returned_model, returned_opt, _ = aiak.optimize(model, opt, strategy={
            "tune": False, "grad_accumulation": 2, "comm": {"engine": "fsdp2"}, "optimizer": {"fused": True}})
        for step in range(2):
            for micro in range(2):
                loss_of(returned_model, batch(rank, 10 * step + micro)).backward()
                returned_opt.step()
                returned_opt.zero_grad()
        reference, ref_opt = _optimizer_with_state(make, batch, loss_of, world)
        for step in range(2):
            together = _concat([batch(r, 10 * step + micro) for micro in range(2) for r in range(world)])
            loss_of(reference, together).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        effects = dict((knob, effect) for knob, _, effect in aiak.last_decision().effects)
        local = sum(p.to_local().numel() for p in returned_model.parameters())
        state = sum(v.to_local().numel() for s in returned_opt.state.values() for v in s.values()
                    if hasattr(v, "to_local"))
        out[name] = {"weights": [p.full_tensor().detach().clone() for p in returned_model.parameters()],
                     "reference": [p.detach().clone() for p in reference.parameters()],
                     "comm": effects["comm"], "fused": effects["optimizer.fused"], "same_optimizer": returned_opt is opt, "same_model": returned_model is model,
                     "local": local, "full": sum(p.numel() for p in reference.parameters()), "state": state}
    return out


if __name__ == "__main__":
    main(globals())
