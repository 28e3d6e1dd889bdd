"""What aiak keeps on the user's objects (:mod:`aiak.runtime.marks`): declared once, under the attribute names users
see, and a name not declared is refused."""
import ast
from pathlib import Path

import pytest
import torch

from aiak.runtime import marks


def test_marks_are_declared_and_an_unknown_one_raises():
    class Holder:
        pass

    obj = Holder()
    marks.mark(obj, "_aiak_built", True)
    assert obj._aiak_built is True and marks.marked(obj, "_aiak_built") is True   # the attribute name users see
    marks.unmark(obj, "_aiak_built")
    assert marks.marked(obj, "_aiak_built", False) is False
    with pytest.raises(KeyError, match="_aiak_steps"):
        marks.marked(obj, "_aiak_step")
    assert all(row.holds and row.on for row in marks.MARKS.values())


def test_a_mark_read_from_the_objects_own_dict_is_not_seen_through_a_forwarding_wrapper():
    inner = torch.nn.Linear(2, 2)

    class Forwarding(torch.nn.Module):
        def __getattr__(self, name):
            return getattr(inner, name)

    marks.mark(inner, "_aiak_keep_fp32", True)
    assert marks.marked(inner, "_aiak_keep_fp32") is True
    assert marks.marked(Forwarding(), "_aiak_keep_fp32", False) is False


def test_every_mark_aiak_reads_or_writes_goes_through_the_accessor_and_is_declared():
    """No ``obj._aiak_x`` and no ``getattr``/``setattr``/``hasattr`` of an ``"_aiak_…"`` name in aiak: each goes
    through :func:`~aiak.runtime.marks.mark` / ``marked`` / ``unmark``, with a declared name."""
    root = Path(__file__).resolve().parents[2] / "aiak"
    raw, undeclared = [], []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_aiak_"):
                raw.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_aiak_"):
                if node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
                    raw.append(f"{where}: {node.func.id}(..., {node.args[1].value!r})")
                elif node.func.id in ("mark", "marked", "unmark") and node.args[1].value not in marks.MARKS:
                    undeclared.append(f"{where}: {node.args[1].value!r}")
    assert not raw, "aiak's marks read or written around aiak.runtime.marks:\n" + "\n".join(raw)
    assert not undeclared, "marks not declared in aiak.runtime.marks.MARKS:\n" + "\n".join(undeclared)
