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


def install_hint(*packages: str) -> str:
    """The ``pip install`` line for ``packages`` that keeps the installed torch: torch pinned to its version, and for
    a build from PyTorch's own index (``2.13.0+cpu``) that index added, since the libraries built on torch
    (torchvision, which timm needs) must come from it. A bare ``pip install timm`` beside torch 2.13.0 resolves a
    torchvision for another torch and replaces torch with a CUDA build of several GB."""
    version = installed_version("torch")
    if version is None:
        return f"pip install {' '.join(packages)}"
    base, _, build = version.partition("+")
    index = f" --extra-index-url https://download.pytorch.org/whl/{build}" if build else ""
    return f'pip install {" ".join(packages)} "torch=={base}"{index}'
