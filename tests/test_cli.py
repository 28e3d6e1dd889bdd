"""The ``aiak`` command line, run as a user would (console script through ``python -m aiak.cli``)."""
import re
import subprocess
import sys

import pytest


def run(*args, timeout=180):
    out = subprocess.run([sys.executable, "-m", "aiak.cli", *args], capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def test_profiles_lists_and_shows():
    code, out, _ = run("profiles")
    assert code == 0 and "default" in out and "swin" in out and "large_batch" in out
    code, out, _ = run("profiles", "swin")
    assert code == 0 and "level: O2" in out and "dtype: bf16" in out


SOURCES = r"default|user|measured|profile:\S+"
KNOB_ROW = re.compile(rf"^  (?P<knob>[a-z_][\w.]*)\s+(?P<value>\S.*?)\s+(?P<source>{SOURCES})\s+(?P<reason>\S.*)$")


def knob_rows(out):
    """The knob table of ``aiak explain``: {knob: {value, source, reason}}; every row must parse."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["knob", "value", "source", "reason"])
    rows = {}
    for line in lines[header + 1:]:
        match = KNOB_ROW.match(line)
        if match is not None:
            rows[match["knob"]] = match.groupdict()
            continue
        # the table ends at the trials or the next section; anything else is a knob row without a value,
        # a source or a reason
        assert not line.strip() or line.split()[0].rstrip(":") in ("trials", "cached", "applied"), line
        break
    return rows


def explain(*args, timeout=300):
    code, out, err = run("explain", *args, timeout=timeout)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    return out


def test_explain_swin_picks_fused_window_attention_and_every_knob_has_a_source():
    out = explain("--model", "timm:swin_tiny_patch4_window7_224", "--input-shape", "3,64,64")
    assert out.startswith("model timm:swin_tiny_patch4_window7_224: timm SwinTransformer, 28.27M parameters, "
                          "input 3x64x64, batch 32, AdamW; device cpu; rules only")
    rows = knob_rows(out)
    assert "window_attention" in rows["fused_ops"]["value"] and rows["fused_ops"]["source"].startswith("profile:")
    # every leaf knob of the strategy is listed, each with a source and a reason (the regex demands both)
    assert {"tf32", "channels_last", "compile", "precision.level", "precision.dtype", "loader.prefetch",
            "comm.bucket_mb", "tune.enabled"} <= set(rows)
    assert "step ms" not in out  # rules only: no trial ran


def test_explain_resnet_picks_channels_last():
    rows = knob_rows(explain("--model", "timm:resnet18", "--input-shape", "3,64,64", "--batch-size", "8"))
    assert rows["channels_last"]["value"] == "true" and rows["channels_last"]["source"].startswith("profile:")
    assert rows["fused_ops"]["value"] in ("[]", "none") and rows["fused_ops"]["source"] == "default"


def test_explain_a_named_profile_says_its_knobs_come_from_it():
    rows = knob_rows(explain("large_batch"))
    assert rows["grad_accumulation"]["value"] == "4" and rows["grad_accumulation"]["source"] == "profile:large_batch"
    assert rows["precision.level"]["source"] == "default"


def test_explain_tune_on_demo_measures_the_candidates():
    out = explain("--tune")
    assert out.startswith("model demo: DemoNet") and "measured (--tune)" in out
    knob_rows(out)
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["candidate", "step", "ms"])
    trials = []
    for line in lines[head + 1:]:
        cells = line.split()
        if len(cells) < 3 or not line.startswith("    "):
            break
        trials.append(cells)
    labels = [cells[0] for cells in trials]
    assert "plain" in labels and len(trials) >= 2, lines[head:]
    plain = trials[labels.index("plain")]
    assert float(plain[1]) > 0  # a measured step time
    assert sum("chosen" in line for line in lines[head + 1:head + 1 + len(trials)]) == 1


@pytest.mark.parametrize("args, message", [
    (("swim",), "did you mean 'swin'"),
    (("--model", "timm:resnt18"), "timm has no model 'resnt18' (did you mean 'resnet18'?)"),
    (("--model", "nope"), "unknown model spec 'nope'; the forms are demo, timm:NAME, torchvision:NAME, hf:NAME"),
    (("--input-shape", "3,64"), "bad input shape '3,64': give C,H,W for images"),
    (("--input-shape", "1,32,32"), "model 'demo' takes 3-channel images"),
    (("--batch-size", "0"), "--batch-size must be a whole number >= 1, got 0"),
    (("--batch-size", "x"), "--batch-size must be a whole number >= 1, got x"),
    (("--device", "gpu"), "--device 'gpu': expected cpu, cuda or cuda:N"),
], ids=["strategy", "timm-name", "spec-form", "shape", "channels", "batch-size", "batch-size-text", "device"])
def test_explain_mistakes_are_one_line_and_exit_2(args, message):
    code, out, err = run("explain", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("aiak: ") and message in lines[0], err
    assert out == ""


def test_doctor_reports_the_environment():
    code, out, _ = run("doctor")
    assert code == 0 and "torch" in out and "cuda" in out and "triton" in out


@pytest.mark.slow
def test_demo_trains_both_and_reports_throughput_and_loss():
    code, out, err = run("demo", "--epochs", "1", "--samples", "512", "--no-progress")
    assert code == 0, err
    lines = [l.split() for l in out.splitlines() if l.split()[:1] in (["baseline"], ["aiak"]) and len(l.split()) == 4]
    assert [l[0] for l in lines] == ["baseline", "aiak"]
    losses = [float(l[3]) for l in lines]
    assert all(0 < v < 2.3 for v in losses)  # both learned something (chance level is ln 10 = 2.30)
    assert "speedup" in out
