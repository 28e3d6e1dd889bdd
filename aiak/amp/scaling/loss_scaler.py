"""Loss scaling for fp16 training (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2).

Dynamic scaling follows apex's ``DynamicLossScaler`` defaults: start at 2**16, double after 2000 steps
without overflow, halve on overflow, never above 2**24. A static scaler keeps its scale but still skips
steps whose gradients overflowed.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch



class LossScaler:
    """Holds the scale (applied at the root of each backward pass by `aiak.amp.scaling.root_scaling`), checks
    gradients for overflow and decides whether a step may be taken."""

    def __init__(self, init_scale: float = 2.0 ** 16, dynamic: bool = True, growth_interval: int = 2000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, max_scale: float = 2.0 ** 24,
                 min_scale: float = 1.0):
        if init_scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {init_scale}")
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.max_scale = max_scale
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped_steps = 0
        self.stood_aside = False  # a script's own GradScaler scales this model's loss instead
        self._updated = (-1, False)  # (the backward pass it was last updated after, and whether that found inf)

    def grad_scale(self) -> float:
        """The factor a backward pass through this model is multiplied by at its root (read as it starts): the
        scale, or 1 once a script's own ``torch.amp.GradScaler`` scales this model's loss
        (`aiak.amp.scaling.script_scaler`)."""
        return 1.0 if self.stood_aside else self.scale

    @staticmethod
    def check_and_multiply_(grads: Iterable[torch.Tensor], factor=1.0) -> bool:
        """Multiply ``grads`` by ``factor`` (a number or a one-element tensor) in place (one fused pass per device and dtype; a sparse gradient's
        values); return True if any of them holds inf or NaN."""
        grads = [g._values() if g.is_sparse else g for g in grads if g is not None]
        found_inf = False
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            flag = torch.zeros(1, device=device)
            inv = factor.reshape(1).to(device, torch.float32) if isinstance(factor, torch.Tensor) \
                else torch.full((1,), factor, device=device)
            for dtype in {g.dtype for g in group}:
                torch._amp_foreach_non_finite_check_and_unscale_([g for g in group if g.dtype == dtype], flag, inv)
            found_inf = found_inf or bool(flag.item())
        return found_inf

    def update(self, found_inf: bool, after_pass: int = -1) -> None:
        """One step's verdict: back off on ``found_inf``, else count a clean step (and grow after
        ``growth_interval`` of them). ``after_pass``: the number of the last scaled backward pass
        (`aiak.amp.scaling.root_scaling.passes_scaled`), for `update_once`."""
        self._updated = (after_pass, found_inf)
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def update_once(self, found_inf: bool, after_pass: int) -> None:
        """`update`, at most once per backward pass for a clean step and once for an overflow: several
        optimizers stepping one model after the same pass (one per parameter, inside the backward) make one step of
        the scale's schedule, as ``GradScaler.update()`` once per iteration does."""
        last_pass, last_inf = self._updated
        if last_pass == after_pass and (last_inf or not found_inf):
            return
        self.update(found_inf, after_pass)

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.dynamic = bool(state.get("dynamic", self.dynamic))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g}, skipped={self.skipped_steps})"
