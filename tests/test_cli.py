"""The ``aiak`` command line, run as a user would (console script through ``python -m aiak.cli``)."""
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


def test_explain_says_what_each_knob_does_and_why():
    code, out, _ = run("explain", "large_batch")
    assert code == 0
    assert "grad_accumulation" in out and "optimizer steps every 4 step() calls" in out
    assert "tf32" in out and "skipped (no CUDA" in out
    code, out, _ = run("explain")
    assert code == 0 and "why:" in out and "loader.prefetch" in out


def test_bad_profile_is_one_clear_line():
    code, _, err = run("explain", "swim")
    assert code == 2 and "did you mean 'swin'" in err and "Traceback" not in err


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
