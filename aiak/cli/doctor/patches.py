"""aiak's global patches of torch as ``aiak doctor`` reports them: information, not checks.

A patch is something aiak does to torch, not something wrong with the machine, so it is neither a pass nor a
fail: the report gives one short line each (installed in this process or not, and when aiak installs it) after the
checks, and the whole story (what it replaces, why, what undoing it puts back) under ``--verbose``, in ``--json``
and in ``aiak.patches()``.
"""
from __future__ import annotations

import textwrap
from typing import Any, Dict, List, Sequence

from aiak.runtime.patches import DECLARED, Patch

PATCHES_TITLE = ("aiak's global patches of torch: information, not checks (--verbose: what each replaces and why; "
                 "aiak.undo_patches() undoes them)")
KEY_WIDTH = 16
WIDTH = 118  # the verbose lines' width


def patch_rows(installed: Sequence[Patch]) -> List[Dict[str, Any]]:
    """One row per declared patch, in `DECLARED`'s order: ``key``, ``installed`` (in this process), ``replaces``
    (the targets replaced where installed, else what it would replace), ``when``, ``why``, ``undone``."""
    now = {p.key: p for p in installed}
    return [{"key": key, "installed": key in now,
             "replaces": ", ".join(now[key].targets) if key in now else row.replaces,
             "when": row.when, "why": row.why, "undone": row.undone} for key, row in DECLARED.items()]


def render_patches(rows: Sequence[Dict[str, Any]], verbose: bool = False) -> List[str]:
    """The report's section: its title, then one line per patch; with ``verbose``, what it replaces, why and what
    undoing it puts back under each, wrapped."""
    lines = [PATCHES_TITLE]
    for row in rows:
        if row["installed"]:
            targets = row["replaces"].split(", ")
            state = f"installed in this process: {targets[0]}" + (
                f" and {len(targets) - 1} more" if len(targets) > 1 else "")
        else:
            state = f"not installed; aiak installs it {row['when']}"
        lines.append(f"  {row['key']:<{KEY_WIDTH}} {state}")
        if verbose:
            for label in ("replaces", "why", "undone"):
                lines += textwrap.wrap(f"{label}: {row[label]}", WIDTH, initial_indent=" " * 6,
                                       subsequent_indent=" " * 8)
    return lines
