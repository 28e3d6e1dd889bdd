"""The quick subset of ``benchmarks/precision_zoo.py``: a timm CNN, a torchvision CNN, a Hugging Face encoder and
decoder, a timm ViT and torchvision's Swin, each under O2 bf16 and O1 fp16 through the benchmark's own checks
(optimize, two training steps, eval under ``inference_mode``, ``state_dict`` dtypes, resume from a checkpoint).
Every cell passes, or ``aiak.optimize`` refuses the precision cleanly (an exception from optimize itself, before
anything ran)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("precision_zoo", ROOT / "benchmarks" / "precision_zoo.py")
zoo = importlib.util.module_from_spec(_spec)
sys.modules["precision_zoo"] = zoo   # its dataclasses look their module up there
_spec.loader.exec_module(zoo)

_LIBRARY = {"timm": "timm", "torchvision": "torchvision", "hf": "transformers"}


def test_the_quick_subset_covers_each_kind_and_the_zoo_is_large():
    assert [name.split(":")[0] for name in zoo.QUICK] == ["timm", "torchvision", "hf", "hf", "timm", "torchvision"]
    assert {zoo.CASES[name].task for name in zoo.QUICK} == {"image", "hf-cls", "hf-lm"}
    assert len(zoo.CASES) >= 30 and set(zoo.DEFAULT_PRECISIONS) == {"O2 bf16", "O1 fp16"}


@pytest.mark.parametrize("name", zoo.QUICK)
def test_quick_model_passes_every_check_or_is_refused_cleanly(name):
    pytest.importorskip(_LIBRARY[name.split(":")[0]])
    cells = zoo.sweep_model(zoo.CASES[name], list(zoo.DEFAULT_PRECISIONS))
    assert set(cells) == set(zoo.DEFAULT_PRECISIONS)
    for precision, cell in cells.items():
        assert cell["status"] in ("pass", "refused"), f"{name} {precision}: {cell['failures']}"
        if cell["status"] == "refused":
            assert list(cell["checks"]) == ["optimize"] and cell["failures"][0].startswith("refused at optimize(): ")
        else:
            assert all(cell["checks"][check] is None for check in zoo.CHECKS), cell["checks"]
            half, calls = cell["half_calls"]
            assert calls > 0 and half > 0, f"{name} {precision}: no Linear/Conv call computed in half"


def test_a_failing_check_is_reported_and_the_sweep_goes_on(monkeypatch):
    """A check that raises is that check's failure (type and first line), the later independent checks still run,
    and the cell text names the first failure with a count of the others."""
    pytest.importorskip("timm")

    def broken_eval(run):
        raise RuntimeError("eval broke\nsecond line")

    monkeypatch.setattr(zoo, "check_eval", broken_eval)
    cell = zoo.check_cell(zoo.CASES["timm:resnet10t"], "O2 bf16")
    assert cell["status"] == "fail"
    assert cell["checks"]["eval"] == "RuntimeError: eval broke"
    assert cell["failures"][0] == "eval: RuntimeError: eval broke"
    assert "state_dict" in cell["checks"] and "resume" in cell["checks"]
    assert zoo.cell_text(cell).startswith("eval: RuntimeError: eval broke")


def test_an_exception_from_optimize_is_a_clean_refusal(monkeypatch):
    pytest.importorskip("transformers")
    import aiak

    def refuse(*args, **kwargs):
        raise aiak.StrategyError("precision: not on this device\nmore")

    monkeypatch.setattr(aiak, "optimize", refuse)
    cell = zoo.check_cell(zoo.CASES["hf:bert"], "O1 fp16")
    assert cell["status"] == "refused"
    assert cell["failures"] == ["refused at optimize(): StrategyError: precision: not on this device"]
    counts = zoo.summary({"m": {"O1 fp16": cell}})
    assert counts == {"pass": 0, "fail": 0, "refused": 1}

