"""What is synchronised: ``comm.algorithm``, one class of `CommAlgorithm` per
file, registered here by name.

Validation (the choices of ``comm.algorithm``, the settings each cannot run with), ``aiak explain`` (what each
trades) and DDP's wrapping read `REGISTRY`; nothing else names the algorithms. A new one is its file (the
class, and the dataclass of its settings section if it has one), its line below, and that section's field in
`CommConfig` (its YAML key; ``tests/comm/test_algorithm_registry.py`` fails while one is
missing).
"""
from typing import Dict, Type

from aiak.comm.algorithms.allreduce import AllReduce
from aiak.comm.algorithms.base import CommAlgorithm
from aiak.comm.algorithms.decentralized import Decentralized
from aiak.comm.algorithms.local_sgd import LocalSGD
from aiak.comm.algorithms.powersgd import PowerSGD

REGISTRY: Dict[str, Type[CommAlgorithm]] = {cls.name: cls for cls in (
    AllReduce,       # every step's gradients, DDP's arithmetic (the default)
    LocalSGD,        # Lin et al., 2020
    Decentralized,   # Lian et al., 2017
    PowerSGD,        # Vogels et al., 2019
)}


def algorithm_class(name: str) -> Type[CommAlgorithm]:
    """The class registered as ``name``; a ``ValueError`` names the valid ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"comm.algorithm must be one of {list(REGISTRY)}, got {name!r}") from None


__all__ = ["CommAlgorithm", "REGISTRY", "algorithm_class", "AllReduce", "LocalSGD", "Decentralized", "PowerSGD"]
