"""Progress of ``aiak demo`` and ``aiak bench``: one live bar per contender, or plain lines.

On a terminal the bars come from `rich <https://github.com/Textualize/rich>`_ (the ``aiak[cli]`` extra), or
from tqdm when only that is installed. When the output is not a terminal (a CI log, ``> file``) or neither
library is there, a plain line is written at every tenth of a contender's steps: a redirected ``\\r`` bar
once wrote one enormous line of frames. The bars write to stderr, so that stdout keeps only the results
(the table, or the JSON of ``--json``).
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Dict, Optional, TextIO

from aiak.util.status_line import is_terminal

__all__ = ["Board"]


def _library(stream: TextIO) -> str:
    """``"rich"``, ``"tqdm"`` or ``"lines"``: what `Board` draws with on ``stream``."""
    if not is_terminal(stream):
        return "lines"
    for name in ("rich", "tqdm"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "lines"


class Board:
    """Bars for named tasks of known length: ``with Board({"baseline": 200, "aiak": 200}) as b: b.update(
    "aiak", done, loss)``. ``enabled=False`` draws nothing; ``library`` forces ``"rich"``, ``"tqdm"`` or
    ``"lines"`` (default: chosen for ``stream``). A task that turns out longer is announced with `note` and
    `grow`, so that no count goes past its total and no step runs unseen."""

    def __init__(self, totals: Dict[str, int], *, enabled: bool = True, stream: TextIO = None,
                 library: Optional[str] = None):
        self.totals = dict(totals)
        self.stream = stream if stream is not None else sys.stderr
        self.library = "off" if not enabled else (library or _library(self.stream))
        self._bars: Dict[str, object] = {}
        self._last_line: Dict[str, int] = {}
        self._done: Dict[str, int] = {}
        self._rich = None
        self._width = max((len(n) for n in self.totals), default=0)

    def __enter__(self) -> "Board":
        if self.library == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[loss]}"), TimeElapsedColumn(),
                                  console=Console(file=self.stream), redirect_stdout=False, redirect_stderr=False)
            self._rich.__enter__()
            for name, total in self.totals.items():
                self._bars[name] = self._rich.add_task(f"{name:<{self._width}}", total=total, loss="")
        elif self.library == "tqdm":
            from tqdm import tqdm

            for i, (name, total) in enumerate(self.totals.items()):
                self._bars[name] = tqdm(total=total, desc=f"  {name:<{self._width}}", position=i, file=self.stream,
                                        leave=True, dynamic_ncols=True)
        return self

    def update(self, name: str, done: int, loss: Optional[float] = None) -> None:
        """``name`` has done ``done`` of its steps; ``loss`` is its latest loss (a float), if known."""
        total = self.totals[name]
        self._done[name] = done
        text = "" if loss is None else f"loss {loss:.4f}"
        if self.library == "rich":
            self._rich.update(self._bars[name], completed=done, loss=text)
        elif self.library == "tqdm":
            bar = self._bars[name]
            bar.update(done - bar.n)
            bar.set_postfix_str(text, refresh=False)
        elif self.library == "lines":
            tenth = done * 10 // max(total, 1)
            if tenth > self._last_line.get(name, 0) or done == total and self._last_line.get(name) != 10:
                self._last_line[name] = 10 if done == total else tenth
                self.stream.write(f"  {name:<{self._width}}  {done:>6}/{total} steps  {text}\n")
                self.stream.flush()

    def grow(self, name: str, total: int) -> None:
        """``name`` runs ``total`` steps in all, more than announced: its bar's end moves there (plain lines go
        on at each tenth of the new total)."""
        self.totals[name] = total
        if self.library == "rich":
            self._rich.update(self._bars[name], total=total)
        elif self.library == "tqdm":
            self._bars[name].total = total
            self._bars[name].refresh()
        elif self.library == "lines":
            self._last_line[name] = self._done.get(name, 0) * 10 // max(total, 1)

    def note(self, text: str) -> None:
        """One line between the bars: why the plan changed."""
        if self.library == "rich":
            self._rich.console.print(text, markup=False, highlight=False)
        elif self.library == "tqdm":
            from tqdm import tqdm

            tqdm.write(text, file=self.stream)
        elif self.library == "lines":
            self.stream.write(text + "\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self.library == "rich":
            self._rich.__exit__(*exc)
        elif self.library == "tqdm":
            for bar in self._bars.values():
                bar.close()
