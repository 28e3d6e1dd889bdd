"""``graph_counts(fn, *args)``: how many graphs and graph breaks ``torch._dynamo.explain`` finds in ``fn(*args)``,
from a reset compiler (and reset again afterwards), for tests that count an interception's graph breaks against
plain PyTorch's; ``graph_breaks`` gives the breaks' reasons, for a failing test to say."""
import torch


def _explain(fn, *args):
    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(fn)(*args)
    finally:
        torch._dynamo.reset()


def graph_counts(fn, *args):
    explained = _explain(fn, *args)
    return explained.graph_count, explained.graph_break_count


def graph_breaks(fn, *args):
    return [f"{b.reason} at {b.user_stack[-1] if b.user_stack else '?'}" for b in _explain(fn, *args).break_reasons]
