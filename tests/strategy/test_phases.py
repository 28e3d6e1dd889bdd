"""The phase table partitions the knob table, runs in the design's order, is the order ``apply.py`` runs, reads
only what it declares, and is the table ARCHITECTURE.md shows."""
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aiak import apply
from aiak.strategy import knobs, phases
from aiak.strategy.profiles import load_strategy

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"

# The order of applying a strategy: switches, surgery, precision and the optimizer swap (with the layout and the
# step controller that owns optimizer.step()), DDP and its hook, torch.compile, the loader.
DESIGN_ORDER = (("switches",), ("surgery",), ("optimizer", "channels_last", "precision", "step_controller"),
                ("ddp",), ("compile",), ("loader",))


def test_every_knob_is_applied_by_exactly_one_phase_or_chooses_the_strategy():
    for row in knobs.KNOBS:
        owners = [p.name for p in phases.PHASES if row in phases.knobs_of(p)]
        expected = 0 if row.acts_on == knobs.SELECTION else 1
        assert len(owners) == expected, (row.path, owners)


def test_each_phase_names_only_knobs_of_the_table():
    for phase in phases.PHASES:
        for read in phase.reads + phase.looks_at:
            assert any(phases.reads(read, k) for k in knobs.KNOBS), (phase.name, read)
        assert not set(phase.looks_at) & set(phase.reads), phase.name


def test_the_phases_run_in_the_designs_order_and_apply_py_runs_them():
    names = tuple(p.name for p in phases.PHASES)
    assert names == sum(DESIGN_ORDER, ())
    assert tuple(apply.PHASES) == names


def test_another_optimizer_runs_the_phases_whose_knobs_act_per_optimizer():
    assert apply.PER_OPTIMIZER == ("optimizer", "step_controller", "loader")
    kept = {k.path.partition(".")[0] for p in phases.PHASES if p.name not in apply.PER_OPTIMIZER
            for k in phases.knobs_of(p)}
    assert kept == set(knobs.model_knobs())   # every other phase's knobs are the model's, kept as first applied


class _Recording:
    """A strategy whose top-level keys, when read, are noted in ``seen``."""

    def __init__(self, strategy, seen):
        self._strategy, self._seen = strategy, seen

    def __getattr__(self, name):
        self._seen.add(name)
        return getattr(self._strategy, name)


def test_a_phase_reads_only_the_knobs_its_row_declares(monkeypatch):
    """Each phase of ``apply.py``, run on a strategy that notes what is read, reads only the sections of the knobs
    its row applies or looks at."""
    seen = {name: set() for name in apply.PHASES}

    def recording(name, run):
        def run_recorded(ctx):
            strategy, ctx.strategy = ctx.strategy, _Recording(ctx.strategy, seen[name])
            try:
                run(ctx)
            finally:
                ctx.strategy = strategy
        return run_recorded

    monkeypatch.setattr(apply, "PHASES", {name: recording(name, run) for name, run in apply.PHASES.items()})
    s = load_strategy({"channels_last": True, "grad_accumulation": 2, "precision": {"level": "O2", "dtype": "bf16"},
                       "loader": {"prefetch": 1}})
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 2))
    loader = DataLoader(TensorDataset(torch.randn(4, 3, 6, 6), torch.randint(0, 2, (4,))), batch_size=2)
    apply.apply_strategy(s, model, torch.optim.SGD(model.parameters(), lr=0.1), loader, None, None,
                         distributed=False)
    for phase in phases.PHASES:
        declared = {path.partition(".")[0] for path in phase.reads + phase.looks_at}
        assert seen[phase.name] and seen[phase.name] <= declared, (phase.name, seen[phase.name])


HEADER = "| phase | knobs it applies | what it applies | what the rollback puts back |"


def _markdown_row(phase):
    names = ", ".join(f"`{path}`" for path in phase.reads)
    looks = f"; looks at {', '.join(f'`{path}`' for path in phase.looks_at)}" if phase.looks_at else ""
    return f"| `{phase.name}` | {names}{looks} | {phase.applies} | {phase.rollback} |"


def test_architecture_shows_the_phase_table_as_it_is():
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index(HEADER) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert lines[start:end] == [_markdown_row(p) for p in phases.PHASES]
