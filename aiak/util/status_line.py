"""One status line on a terminal for work that takes a while (the trials of ``auto``), in the manner of tqdm's bar:
rewritten in place with ``\\r``, cleared when the work ends, shown only once the work has run
`SHOW_AFTER_S` seconds, and silent where stderr is not a terminal (a log file, CI) or on ranks other than 0,
so logs never fill with frames."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from aiak.util.warn import is_rank_zero

SHOW_AFTER_S = 2.0   # work shorter than this shows nothing


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (a person watching), not a file, a pipe or a CI log."""
    return bool(getattr(stream, "isatty", lambda: False)())


class StatusLine:
    """``with StatusLine("timing 4 candidates") as line: line.update("round 3")`` shows
    ``aiak: timing 4 candidates: round 3, 5 s`` on a terminal's stderr."""

    def __init__(self, what: str, stream: Optional[TextIO] = None):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.enabled = is_terminal(self.stream) and is_rank_zero()
        self.shown = False

    def update(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        if not self.enabled or elapsed < SHOW_AFTER_S:
            return
        self.stream.write(f"\r\033[Kaiak: {self.what}: {text}, {elapsed:.0f} s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def __enter__(self) -> "StatusLine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
