"""The knob table covers the schema exactly, and the lists derived from it say what the table says."""
import dataclasses

import pytest

from aiak.strategy import knobs
from aiak.strategy.schema import Strategy
from aiak.strategy.select import leaves

NOT_KNOBS = ("name", "extends", "description", "match")


def _schema_paths():
    """Every key path of a strategy, sections opened (the optimizer's hyper-parameters are its section's)."""
    data = {k: v for k, v in Strategy().to_dict().items() if k not in NOT_KNOBS}
    return {path for path, _ in leaves(data)}


def test_every_key_of_the_schema_has_exactly_one_row():
    rows = [k.path for k in knobs.KNOBS]
    assert len(rows) == len(set(rows)), "a knob listed twice"
    missing = [p for p in sorted(_schema_paths()) if not any(p == r or p.startswith(r + ".") for r in rows)]
    assert not missing, f"schema keys without a row in aiak.strategy.knobs.KNOBS: {missing}"
    fields = {f.name for f in dataclasses.fields(Strategy)} - set(NOT_KNOBS)
    for row in rows:
        section, _, key = row.partition(".")
        assert section in fields, row
        if key:
            assert key in {f.name for f in dataclasses.fields(type(getattr(Strategy(), section)))}, row


def test_a_hyperparameter_belongs_to_the_optimizer_row():
    assert knobs.knob("optimizer.lr").path == "optimizer"
    with pytest.raises(KeyError, match="no knob 'optimiser'"):
        knobs.knob("optimiser")


def test_the_derived_lists_follow_the_columns():
    assert {"tf32", "cudnn_benchmark", "cpu_affinity", "channels_last", "compile", "precision", "fused_ops",
            "comm"} <= set(knobs.model_knobs())
    assert not {"optimizer", "grad_accumulation", "loader", "tune"} & set(knobs.model_knobs())
    assert "channels_last" in knobs.neutral_keys() and "precision.level" not in knobs.neutral_keys()
    assert "comm.compression" not in knobs.neutral_keys() and "comm.bucket_mb" in knobs.neutral_keys()
    assert set(knobs.training_keys()) & set(knobs.untimed_keys()) == set()
    assert {"grad_accumulation", "optimizer"} <= set(knobs.training_keys())
    assert not any(k.startswith(("precision", "channels_last", "compile", "fused_ops", "tf32"))
                   for k in knobs.untimed_keys())


def test_each_process_knob_writes_only_the_settings_its_row_names(monkeypatch):
    """Applied on (as on an Ampere GPU, whose capability the hardware facts report), each process knob changes
    only the process settings its row lists: those the rollback and the trials put back."""
    import torch

    from aiak.runtime.switches import process_switches, read_switches, write_switches
    from aiak.util.machine import devices

    monkeypatch.setattr(devices, "cuda_capability", lambda device: (8, 0))
    names = set(process_switches())
    for row in knobs.process_knobs():
        assert row.apply is not None and set(row.switches) <= names, row.path
        before = read_switches()
        try:
            for name, (_, write) in process_switches().items():   # start from settings the knob would change
                if name in ("matmul.allow_tf32", "cudnn.allow_tf32", "cudnn.benchmark", "malloc_retain"):
                    write(False)
            start = read_switches()
            row.apply(True, torch.device("cuda", 0))
            changed = {name for name, value in read_switches().items() if value != start[name]}
            assert changed <= set(row.switches), (row.path, changed)
            if row.path != "cpu_affinity":    # binding to the cores this process already has may change nothing
                assert changed, row.path
        finally:
            write_switches(before)
