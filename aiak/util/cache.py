"""The one tuning cache: a JSON file of decisions, shared by the strategy trials and the comm autotuner.

``{key: entry}`` where an entry is a JSON object; the strategy trials (`aiak.tune.trials`) store the
winning strategy under a key of model structure, batch shape, hardware, topology, library versions and
profiles (`aiak.tune.trials.decision_key`), the comm autotuner its route and bucket size
(`aiak.comm.allreduce.autotune`); both keys are made by `TuneCache.key`. Writes are atomic (temp file +
``os.replace``), so concurrent writers never leave a torn file; an unreadable file is ignored with a warning and
rewritten.

Location: ``$AIAK_TUNE_CACHE``, else ``$XDG_CACHE_HOME/aiak/tune.json`` (``~/.cache/aiak/tune.json``).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from aiak.util.warn import warn

CACHE_ENV = "AIAK_TUNE_CACHE"


def default_cache_path() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aiak" / "tune.json"


class TuneCache:
    """A JSON file ``{key: {...}}``; ``path`` defaults to `default_cache_path`."""

    def __init__(self, path: Optional[os.PathLike] = None):
        self.path = Path(path) if path is not None else default_cache_path()

    @staticmethod
    def key(kind: str, subject: str, fields: Optional[Mapping[str, Any]] = None, digest_of: Any = None) -> str:
        """The one way a key of the cache is made: ``kind|subject|name=value|...``, then, when ``digest_of`` is
        given, ``|`` and the first 24 hex digits of the sha1 of its JSON (keys sorted). ``fields`` are what a
        reader looks for in the file (world size, torch version, comm mode), in their order; ``digest_of`` holds
        what is too long to read there (a model's whole structure, the profiles)."""
        parts = [kind, subject] + [f"{name}={value}" for name, value in (fields or {}).items()]
        if digest_of is not None:
            parts.append(hashlib.sha1(json.dumps(digest_of, sort_keys=True, default=str).encode()).hexdigest()[:24])
        return "|".join(parts)

    def _read(self) -> Dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError(f"top level is {type(data).__name__}, expected an object")
            return data
        except FileNotFoundError:
            return {}
        except (ValueError, OSError) as e:
            warn(f"aiak: ignoring unreadable tuning cache {self.path} ({e}); it will be rewritten")
            return {}

    def get_entry(self, key: str) -> Optional[Dict[str, Any]]:
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) else None

    def put_entry(self, key: str, entry: Dict[str, Any]) -> None:
        data = self._read()
        data[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
