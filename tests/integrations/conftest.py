"""Shared by the framework tests: tiny data, and a clean slate of process-wide state per test."""
import pytest
import torch

from aiak.util import warn


@pytest.fixture(autouse=True)
def _fresh_warnings_and_frameworks():
    """aiak's once-per-process warnings said again in each test; Accelerate's singletons reset (the Trainer and
    Accelerator of one test must not leave their accumulation settings to the next)."""
    saved = set(warn._warned)
    warn._warned.clear()
    yield
    warn._warned.clear()
    warn._warned.update(saved)
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tensors(n_samples=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_samples, 12, generator=g), torch.randint(0, 3, (n_samples,), generator=g)


def max_abs_diff(model_a, model_b) -> float:
    return max(float((a.detach().float() - b.detach().float()).abs().max())
               for a, b in zip(model_a.parameters(), model_b.parameters()))


def aiak_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("aiak:")]
