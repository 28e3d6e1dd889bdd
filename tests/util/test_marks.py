"""What aiak keeps on the user's objects (:mod:`aiak.util.marks`): declared once, under the attribute names users
see, and a name not declared is refused."""
import pytest
import torch

from aiak.util import marks


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

