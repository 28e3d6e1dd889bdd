"""Training scripts written like torchvision's and timm's reference ``train.py`` (``torchvision_style.py``,
``timm_style.py``), run in plain PyTorch and with aiak's one line: what a user gets by adding it to a script
someone else wrote.

* ``strategy="default"`` is plain PyTorch bit for bit, with every feature of the scripts on (EMA, label
  smoothing, clipping, schedules, mixup with its off epoch, the script's own accumulation), in one process and
  under 2 gloo ranks where the script wraps the model in DDP itself after the aiak line (one DDP, whose
  ``module`` is the script's model).
* Strategies that change something real: ``grad_accumulation: 2`` on half batches ends where the full batch does
  (within float rounding; stated per test), with the EMA and the schedules counting real steps, in one process
  and under 2 ranks; a prefetching loader ends bit for bit where plain loading does and still turns mixup off
  at its epoch.
* A run resumed from a checkpoint ends where the uninterrupted run does, plain and under accumulation.
* The script's own accumulation with aiak's on top is said once, and the two do not multiply.

Every run uses one intra-op thread: on this shared 2-core machine two OpenMP threads wait on each other (a
torchvision MobileNet step took 40x longer), and plain and aiak runs must use the same kernels to compare bitwise.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from aiak.util import warn
from tests.scripts import timm_style, torchvision_style
from tests.scripts.synthetic_data import write_image_folder

REPO = Path(__file__).resolve().parents[2]
DEFAULT = "default"
ACCUMULATE_2 = {"grad_accumulation": 2, "tune": False}
PREFETCH_2 = {"loader": {"prefetch": 2}, "tune": False}
FUSED_STEP = {"optimizer": {"fused": True}, "tune": False}

# torchvision: GroupNorm and no dropout, so that two half batches hold exactly the full batch's gradient
TV_PER_SAMPLE = {"norm_layer": "group", "dropout": 0.0}
# timm: no mixup (it mixes within a batch, so halves mix other pairs), a constant rate (the script sizes its
# per-update schedule from len(loader), which doubles with half batches), no accumulation of the script's own
TIMM_PER_SAMPLE = {"mixup": 0.0, "cutmix": 0.0, "sched": "", "grad_accum_steps": 1, "workers": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> str:
    return str(write_image_folder(tmp_path_factory.mktemp("images")))


@pytest.fixture(scope="module")
def run(image_folder, tmp_path_factory):
    """``run(script, checkpoints=False, **args)``: the script's result, with ``warnings`` (aiak's, as a fresh
    process would say them) and, with ``checkpoints``, ``output_dir``. Each configuration runs once per module."""
    done = {}

    def run_script(script, checkpoints: bool = False, **args):
        key = (script.__name__, checkpoints, json.dumps(args, sort_keys=True))
        if key not in done:
            data_arg = "data_path" if script is torchvision_style else "data_dir"
            args = {data_arg: image_folder, **args}
            if checkpoints:
                args["output_dir"] = str(tmp_path_factory.mktemp("checkpoints"))
            said = set(warn._warned)
            warn._warned.clear()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    result = script.main(args)
            finally:
                warn._warned.clear()
                warn._warned.update(said)
            result["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("aiak")]
            result["output_dir"] = args.get("output_dir")
            done[key] = result
        return done[key]

    return run_script


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensor(s) differ, e.g. {different[:3]}"


def assert_close_states(a: dict, b: dict, atol: float, rtol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(b[k], a[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


# -- torchvision style ---------------------------------------------------------------------------------------

def test_torchvision_default_is_plain_pytorch_bit_for_bit(run):
    plain = run(torchvision_style, checkpoints=True)
    tuned = run(torchvision_style, aiak=DEFAULT)
    assert_equal_states(plain["model"], tuned["model"])
    assert_equal_states(plain["model_ema"], tuned["model_ema"])
    for key in ("lr", "grad_norm", "optimizer_steps", "ema_updates", "eval", "eval_ema"):
        assert tuned[key] == plain[key], key
    assert plain["optimizer_steps"] == 12 and plain["ema_updates"] == 6  # 3 epochs of 4 steps, EMA every 2nd
    assert tuned["warnings"] == []


@pytest.mark.parametrize("strategy", ["auto", {"precision": {"level": "O2", "dtype": "bf16"}, "tune": False}],
                         ids=["auto", "O2 bf16"])
def test_torchvision_evaluates_and_checkpoints_as_plain_does(run, strategy):
    """The reference loop evaluates the model and its EMA after every epoch (``model.eval()``, batches under
    ``torch.inference_mode()``) and saves a checkpoint: with ``strategy="auto"`` (bf16 where the machine computes
    it natively) and with O2 bf16 named, every evaluation runs and gives fp32 outputs and a finite loss, and every
    checkpoint holds plain's keys in plain's dtypes and loads into a plain torchvision model. (O2 bf16 used to
    fail at the first evaluation, after a whole epoch of training: "Inference tensors do not track version
    counter".)"""
    plain = run(torchvision_style, checkpoints=True)
    tuned = run(torchvision_style, checkpoints=True, aiak=strategy)
    assert len(tuned["eval"]) == len(tuned["eval_ema"]) == 3
    for result in tuned["eval"] + tuned["eval_ema"]:
        assert result["output_dtype"] == "torch.float32" and result["loss"] == result["loss"] < 10, result
    for epoch in range(3):
        saved, expected = (torch.load(os.path.join(r["output_dir"], f"model_{epoch}.pth"), weights_only=True)
                           for r in (tuned, plain))
        for key in ("model", "model_ema"):
            assert {k: v.dtype for k, v in saved[key].items()} == {k: v.dtype for k, v in expected[key].items()}
        fresh = torchvision_style.create_model(torchvision_style.parse({}), num_classes=saved["model"][
            "classifier.3.weight"].shape[0])
        fresh.load_state_dict(saved["model"])


def test_torchvision_half_batches_under_grad_accumulation_match_the_full_batch(run):
    """Batches of 4 with ``grad_accumulation: 2`` against batches of 8 (GroupNorm, no dropout: the same samples
    in the same order, with the same augmentation). Tolerance: the full batch's mean loss against two half means
    summed and averaged differ by float rounding (1e-7), grown over 12 momentum steps to 6e-5 measured here;
    without accumulation the same half batches end 0.2 away. The EMA follows ``aiak.stepped`` (every 2nd real
    step, 6 in all), the per-epoch schedule sees 12 real steps at plain's rates, and the clip (max norm 1.0,
    every step's norm above it) clips each window's averaged gradient to plain's norm."""
    plain = run(torchvision_style, **TV_PER_SAMPLE)
    halves = run(torchvision_style, checkpoints=True, batch_size=4, aiak=ACCUMULATE_2, **TV_PER_SAMPLE)
    assert halves["optimizer_steps"] == plain["optimizer_steps"] == 12
    assert halves["ema_updates"] == plain["ema_updates"] == 6
    assert halves["lr"] == plain["lr"]
    assert min(plain["grad_norm"]) > 1.0  # the clip acted on every step
    torch.testing.assert_close(halves["grad_norm"], plain["grad_norm"], atol=0, rtol=1e-3)
    assert_close_states(plain["model"], halves["model"], atol=5e-4, rtol=1e-4)
    assert_close_states(plain["model_ema"], halves["model_ema"], atol=5e-4, rtol=1e-4)
    assert halves["warnings"] == []


@pytest.mark.parametrize("setup", ["plain", "grad_accumulation", "fused_step"])
def test_torchvision_resume_equals_an_uninterrupted_run(run, setup):
    """The checkpoint after epoch 0 (model, optimizer with aiak's window counter, SequentialLR, EMA, random state),
    loaded by a second run of the script with ``resume``: it ends bit for bit where the uninterrupted run did (the
    script's SGD stepping torch's fused kernel too: the loaded optimizer stays fused)."""
    args = ({} if setup == "plain" else {"aiak": FUSED_STEP} if setup == "fused_step"
            else {"batch_size": 4, "aiak": ACCUMULATE_2, **TV_PER_SAMPLE})
    whole = run(torchvision_style, checkpoints=True, **args)
    resumed = run(torchvision_style, resume=os.path.join(whole["output_dir"], "model_0.pth"), **args)
    assert resumed["optimizer_steps"] == 8 and resumed["lr"] == whole["lr"][4:]
    assert_equal_states(whole["model"], resumed["model"])
    assert_equal_states(whole["model_ema"], resumed["model_ema"])


# -- timm style ----------------------------------------------------------------------------------------------

def test_timm_default_is_plain_pytorch_bit_for_bit(run):
    """Mixup in epoch 0 only, AGC, ModelEmaV3 with warm-up, per-update cosine schedule and the script's own
    accumulation over 2 batches (a loader worker does the augmentation and the mixing)."""
    plain = run(timm_style)
    tuned = run(timm_style, aiak=DEFAULT)
    assert plain["mixed_batches"] == [8, 0, 0] and plain["updates"] == 12
    for key in ("lr", "updates", "mixed_batches"):
        assert tuned[key] == plain[key], key
    assert_equal_states(plain["model"], tuned["model"])
    assert_equal_states(plain["model_ema"], tuned["model_ema"])
    assert tuned["warnings"] == []


def test_timm_prefetching_loader_turns_mixup_off_and_trains_bit_for_bit(run):
    """``loader: {prefetch: 2}``: a thread loads ahead from the script's loader (its worker draws the random
    numbers, so no fallback to loading in the step is announced); ``loader.mixup_enabled = False`` on the returned
    loader reaches the script's, and the batches, hence the weights, are plain's exactly."""
    plain = run(timm_style)
    prefetched = run(timm_style, aiak=PREFETCH_2)
    assert prefetched["mixed_batches"] == plain["mixed_batches"] == [8, 0, 0]
    assert_equal_states(plain["model"], prefetched["model"])
    assert_equal_states(plain["model_ema"], prefetched["model_ema"])
    assert prefetched["warnings"] == []


@pytest.mark.parametrize("clip_mode,clip_grad", [("norm", 1.0), ("agc", 0.05)])
def test_timm_half_batches_under_grad_accumulation_match_the_full_batch(run, clip_mode, clip_grad):
    """Batches of 4 with aiak's ``grad_accumulation: 2`` against batches of 8, clipped by ``dispatch_clip_grad``:
    ``norm`` reaches torch's ``clip_grad_norm_``, ``agc`` timm's ``adaptive_clip_grad``, which clips each
    parameter's gradient against its weight's norm; either must act on the window's averaged gradient, not on a
    micro-step's partial sum. ModelEmaV3's warm-up decay reads the update count, which must count real updates.
    Tolerance: float rounding of the two half means against the full mean (measured 7e-7 on the weights with
    AGC); the weights of a run that clips partial sums differ by far more."""
    args = {**TIMM_PER_SAMPLE, "clip_mode": clip_mode, "clip_grad": clip_grad}
    plain = run(timm_style, batch_size=8, **args)
    halves = run(timm_style, batch_size=4, aiak=ACCUMULATE_2, **args)
    assert halves["updates"] == plain["updates"] == 12
    assert halves["lr"] == plain["lr"]
    assert_close_states(plain["model"], halves["model"], atol=5e-4, rtol=1e-4)
    assert_close_states(plain["model_ema"], halves["model_ema"], atol=5e-4, rtol=1e-4)
    assert halves["warnings"] == []


def test_timm_own_accumulation_with_aiaks_is_said_once_and_does_not_multiply(run):
    """``--grad-accum-steps 2`` in the script and ``grad_accumulation: 2`` in the strategy: one warning naming
    both, and the script's accumulation alone decides the updates, as plain PyTorch with the script's."""
    plain = run(timm_style)
    stacked = run(timm_style, aiak=ACCUMULATE_2)
    said = [w for w in stacked["warnings"] if "grad_accumulation" in w]
    assert len(said) == 1 and "script" in said[0], stacked["warnings"]
    assert stacked["updates"] == plain["updates"] == 12
    assert stacked["lr"] == plain["lr"]
    assert_equal_states(plain["model"], stacked["model"])


# -- under torchrun: 2 gloo ranks, the scripts' own DDP line after the aiak line -------------------------------

@pytest.fixture(scope="module")
def two_ranks(image_folder, tmp_path_factory):
    """The runs of ``two_ranks.py`` on 2 ranks of one torchrun; per-rank results keyed by ``(setup, strategy)``.
    torchrun runs in its own process group, killed whole if it outlives the timeout."""
    out = tmp_path_factory.mktemp("two_ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tests.scripts.two_ranks", str(out), image_folder]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"torchrun did not finish in 240 s\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,model_class", [("torchvision", "MobileNetV3"), ("timm", "NormFreeNet")])
def test_two_ranks_default_is_plain_ddp_bit_for_bit_with_one_ddp(two_ranks, script, model_class):
    for rank, results in enumerate(two_ranks):
        plain, tuned = results[script, "plain"], results[script, "default"]
        for run in (plain, tuned):  # the script's DDP line gave one DDP around the script's model
            assert run["ddp"] == {"module_type": model_class, "ddp_count": 1}, (rank, run["ddp"])
        assert_equal_states(plain["model"], tuned["model"])
        assert_equal_states(plain["model_ema"], tuned["model_ema"])
    first, second = (r[script, "default"]["model"] for r in two_ranks)
    parameters = [k for k in first if "running_" not in k and "num_batches" not in k]
    assert all(torch.equal(first[k], second[k]) for k in parameters)  # DDP kept the replicas' weights equal


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_half_batches_under_grad_accumulation_match_the_full_batch(two_ranks):
    """The torchvision script's per-sample variant on 2 ranks (16 samples each): batches of 4 with
    ``grad_accumulation: 2`` through the script's DDP line against batches of 8; tolerance as in one process."""
    for rank, results in enumerate(two_ranks):
        plain = results["torchvision_per_sample", "plain"]
        halves = results["torchvision_per_sample", "grad_accumulation"]
        assert halves["ddp"] == {"module_type": "MobileNetV3", "ddp_count": 1}, rank
        assert halves["optimizer_steps"] == plain["optimizer_steps"] == 6, rank
        assert halves["ema_updates"] == plain["ema_updates"] == 3, rank
        assert halves["lr"] == plain["lr"], rank
        assert_close_states(plain["model"], halves["model"], atol=5e-4, rtol=1e-4)
        assert_close_states(plain["model_ema"], halves["model_ema"], atol=5e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_the_scripts_own_accumulation_wins_over_aiaks(two_ranks):
    """timm's --grad-accum-steps 2 (with its no_sync) and grad_accumulation: 2 under DDP: aiak gives way at the
    first step, and the backward passes it had kept out of the allreduce are averaged then, so the replicas agree
    and the run is plain DDP's, to allreduce rounding."""
    for rank, results in enumerate(two_ranks):
        plain, stacked = results["timm", "plain"], results["timm", "stacked_accumulation"]
        assert stacked["updates"] == plain["updates"] > 0, rank
        assert stacked["lr"] == plain["lr"], rank
        assert_close_states(plain["model"], stacked["model"], atol=1e-5, rtol=1e-5)
    first, second = (r["timm", "stacked_accumulation"]["model"] for r in two_ranks)
    assert all(torch.equal(first[k], second[k]) for k in first if "running_" not in k and "num_batches" not in k)


def test_timm_with_the_fused_step_trains_as_plain_to_rounding(run):
    """``optimizer: {fused: true}`` under timm's script (Mixup, AGC, ModelEmaV3, per-update cosine schedule, its own
    accumulation): the same schedule and updates as plain, the weights and the EMA's to float rounding, no warning."""
    plain = run(timm_style)
    fused = run(timm_style, aiak=FUSED_STEP)
    assert all(fused["fused_groups"]) and not any(plain["fused_groups"])
    for key in ("lr", "updates", "mixed_batches"):
        assert fused[key] == plain[key], key
    assert_close_states(plain["model"], fused["model"], atol=1e-5, rtol=1e-4)
    assert_close_states(plain["model_ema"], fused["model_ema"], atol=1e-5, rtol=1e-4)
    assert fused["warnings"] == []
