"""The ``optimizer:`` section of a strategy: keep the user's optimizer, or swap it (`aiak.optim.factory`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from aiak.optim.factory import hyperparameter_problems
from aiak.util.config import Where, choices

OPTIMIZER_NAMES = ("keep", "lamb", "lars")


@dataclass
class OptimizerConfig:
    """``keep`` the user's optimizer, or swap it for LAMB / LARS; ``fused``: the kept optimizer steps with torch's
    fused kernel where its class has one (`aiak.optim.fused_step`); other keys are hyper-parameters."""

    name: str = field(default="keep", metadata=choices(*OPTIMIZER_NAMES))
    fused: bool = False
    hyperparameters: Dict[str, Any] = field(default_factory=dict, metadata={"rest": True})

    def _problems(self, where: Where, path: str) -> List[str]:
        """Hyper-parameters, checked at load time by the optimizer factory's own rules (unknown key with
        "did you mean", wrong type, out of range), so a bad one fails before ``optimize()`` touches anything."""
        if self.name == "keep":
            return [f"{where(path + key)}: hyper-parameters need optimizer.name lamb or lars ('keep' leaves your "
                    f"optimizer as it is)" for key in self.hyperparameters]
        return [problem for key, value in self.hyperparameters.items()
                for problem in hyperparameter_problems(self.name, {key: value}, f"{where.source_of(path + key)}: {path}")]
