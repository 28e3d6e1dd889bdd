"""wrap_distributed without a process group, and argument validation."""
import logging

import pytest
import torch.distributed as dist
import torch.nn as nn

from aiak.comm import CommState, wrap_distributed
from aiak.strategy.schema import CommConfig


def test_without_a_process_group_the_model_is_returned_unchanged(caplog):
    assert not dist.is_initialized()
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.INFO, logger="aiak"):
        assert wrap_distributed(model, CommConfig(compression="fp16")) is model
    assert "no process group" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiak"):
        assert wrap_distributed(model, CommConfig()) is model
    assert caplog.text == ""  # nothing asked for, nothing to say


def test_comm_state_validates_with_an_explanation(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="needs groups"):
            CommState(hierarchical=True)
        with pytest.raises(ValueError, match=r"must be one of \['none', 'fp16', 'bf16', 'int8'\]"):
            CommState(compression="int4")
        model = nn.Linear(2, 2)
        assert wrap_distributed(model, CommConfig(compression="fp16")) is model  # world size 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("options,message", [
    ({"perf_mode": "x"}, r"comm.perf_mode must be one of \['comm', 'step'\], got 'x'"),
    ({"tune_steps": 0}, r"comm.tune_steps must be >= 1"),
    ({"timeout_s": 0}, r"comm.timeout_s must be > 0"),
    ({"pipeline_mb": -1}, r"comm.pipeline_mb must be >= 0"),
])
def test_bad_options_name_the_key_and_choices(options, message):
    with pytest.raises(ValueError, match=message):
        wrap_distributed(nn.Linear(2, 2), CommConfig(), **options)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(TypeError, match="unknown option.*'tune_stepz'.*valid"):
        wrap_distributed(nn.Linear(2, 2), CommConfig(), tune_stepz=3)


def test_options_resolve_argument_then_cfg_then_default():
    from aiak.comm import resolve_options

    assert resolve_options(CommConfig(compression="bf16", tune_steps=7)).tune_steps == 7
    assert resolve_options(CommConfig(tune_steps=7), tune_steps=2).tune_steps == 2
    assert resolve_options(CommConfig()).tune_steps == 3
    assert resolve_options(None, compression="bf16").compression == "bf16"


def test_a_model_the_script_wrapped_in_ddp_gets_precision_and_says_what_it_skipped(tmp_path):
    """optimize() on the script's DistributedDataParallel: the same DDP comes back, its model computes in O2 with
    its parameters untouched (fp32, contiguous: DDP's buckets hold them as they are), and fused_ops and
    channels_last, which would change modules or layouts under DDP, are skipped with a warning each."""
    import warnings

    import torch

    import aiak
    from aiak.amp.half_compute import half_compute_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned, _, _ = aiak.optimize(ddp, opt, strategy={
                "channels_last": True, "fused_ops": ["window_attention"],
                "precision": {"level": "O2", "dtype": "bf16"}})
        said = [str(w.message) for w in caught if str(w.message).startswith("aiak:")]
        assert returned is ddp and returned.module is model and half_compute_of(ddp) is not None
        assert any(m.startswith("aiak: fused_ops skipped") for m in said), said
        assert any(m.startswith("aiak: channels_last skipped") for m in said), said
        assert all(p.dtype == torch.float32 and p.is_contiguous() for p in model.parameters())
        x = torch.randn(2, 3, 8, 8)
        nn.functional.cross_entropy(ddp(x), torch.tensor([0, 1])).backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    finally:
        dist.destroy_process_group()
