"""The installed version of a distribution, by its pip name: the one lookup that the tuning cache's key and
``aiak doctor`` both make."""
from __future__ import annotations

from typing import Optional


def installed_version(dist: str) -> Optional[str]:
    """``importlib.metadata.version(dist)``, or None when ``dist`` is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
