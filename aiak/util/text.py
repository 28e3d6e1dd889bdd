"""Text for people: the "did you mean" of every error about a name, and values written as the YAML of a profile."""
from __future__ import annotations

import difflib
from typing import Any


def did_you_mean(given: Any, choices) -> str:
    """`` (did you mean 'x'?)`` for a near miss (case-insensitive), else ``""``."""
    if not isinstance(given, str):
        return ""
    names = [c for c in choices if isinstance(c, str)]
    by_lower = {c.lower(): c for c in names}
    close = difflib.get_close_matches(given.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close and by_lower[close[0]] != given else ""


def yaml_text(value: Any) -> str:
    """``value`` as a profile would spell it: ``true``/``false``, ``null``, ``[a, b]``, ``{k: v}``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def describe_error(e: BaseException) -> str:
    """``Type: first line of the message`` (200 characters at most): why a trial or a contender stopped, in
    one line of a table."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"
