"""The ``aiak`` command (``demo``, ``bench``, ``explain``, ``doctor``, ``profiles``); run as ``aiak`` or
``python -m aiak.cli``."""
from aiak.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
