"""Whether a given library function is on the call stack: for the few places where aiak must act differently when a
library calls a method it patched than when the script does.

``torch.distributed.checkpoint`` (DCP) is the one such library: ``get_state_dict`` walks a ``DistributedDataParallel``'s
``state_dict()`` keys expecting DDP's ``module.`` prefix (aiak's DDP gives the model's own keys to everyone else), and
``set_state_dict`` initialises a fresh optimizer's state by calling ``optimizer.step()`` with zero gradients and a
zero learning rate (aiak's step controller would count it as a training micro-step). Neither call says who makes
it, so the stack is read: a walk of the frames' code names, a few microseconds, only on those two calls.
"""
from __future__ import annotations

import sys

DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def called_from(module: str, function: str) -> bool:
    """A frame of ``function`` defined in ``module`` (its ``__name__``) is on the stack above the caller."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False
