"""Argument types and the parser of the ``aiak`` command line: a bad value is one line and exit code 2.

argparse prints its usage block and then the error; ``aiak`` prints only the error, naming the argument
and its valid range (``aiak bench: argument --steps: must be a whole number >= 1, got '0'``), and points to
``--help``, where every option has a description and its default.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

__all__ = ["Parser", "whole_number", "device", "input_shape", "HelpFormatter", "STRATEGY_HELP", "MODEL_HELP"]


class HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` to every option's help that has a default and does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            value = ", ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default: {value})"
        return text


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(2)

STRATEGY_HELP = "auto, a built-in profile name (aiak profiles lists them) or a path to a YAML profile"
MODEL_HELP = ("demo, timm:NAME, torchvision:NAME, hf:TYPE or path/to/file.py:factory; random weights, synthetic data, "
              "nothing downloaded")


def whole_number(minimum: int = 1, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]``."""
    bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a whole number {bound}, got {text!r}")
        return value

    parse.__name__ = f"whole number {bound}"
    return parse


def device(text: str):
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``, which must exist here."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (run `aiak doctor` to see why); "
                                             f"use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has cuda:0 to cuda:{count - 1}")
    return dev


def input_shape(text: str):
    """An argparse ``type``: ``C,H,W`` for images or one number, the sequence length, for text."""
    from aiak.cli.model_spec import ModelSpecError, parse_input_shape

    try:
        return parse_input_shape(text)
    except ModelSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
