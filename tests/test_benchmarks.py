"""Benchmarks stay runnable: every script imports, and the quick ones run end to end on CPU."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports_without_running(name):
    code = f"import sys; sys.path.insert(0, 'benchmarks'); import {name}; assert callable({name}.main)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_gpu_check_without_cuda_says_so_and_passes():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "no CUDA device here" in out.stdout


def test_overhead_quick_reports_the_ratio():
    out = subprocess.run([sys.executable, "benchmarks/overhead.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "default / plain =" in out.stdout
