"""Loss anomalies, judged by each rank on the loss every rank agrees on (``docs/faults.md``).

Runs in the workers: a NaN or a spike makes every rank roll back in place
(``elastic/worker/trainer.py``) and report an ``AnomalyReport``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

AnomalyCause = Literal["nan_loss", "loss_spike"]  # AnomalyReport.cause


class LossMonitor:
    """Flags a non-finite loss, or one far above the running statistics (silent corruption)."""

    def __init__(self, spike_factor: float, window: int = 20, min_history: int = 8):
        self.spike_factor = spike_factor
        self.min_history = min_history
        self._history: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> AnomalyCause | None:
        if not math.isfinite(loss):
            return "nan_loss"
        if len(self._history) >= self.min_history:
            mean = sum(self._history) / len(self._history)
            var = sum((x - mean) ** 2 for x in self._history) / len(self._history)
            spread = max(math.sqrt(var), 0.02 * abs(mean))
            if loss > mean + self.spike_factor * spread:
                return "loss_spike"
        return None

    def accept(self, loss: float) -> None:
        self._history.append(loss)
