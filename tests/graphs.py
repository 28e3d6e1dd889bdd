"""``graph_counts(fn, *args)``: how many graphs and graph breaks ``torch._dynamo.explain`` finds in ``fn(*args)``,
from a reset compiler (and reset again afterwards), for tests that count an interception's graph breaks against
plain PyTorch's."""
import torch


def graph_counts(fn, *args):
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*args)
    finally:
        torch._dynamo.reset()
    return explained.graph_count, explained.graph_break_count
