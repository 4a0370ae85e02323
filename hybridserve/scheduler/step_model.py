"""An online step-time model: t = c0 + c_d*decode + c_p*prefill + c_kv*kv_tokens_read.

Recursive least squares with a forgetting factor, coefficients clamped non-negative, seedable
from a cost model. Used by the adaptive mixed-prefill budget (SPEC.md 5.3).

The covariance is kept bounded: with forgetting, a feature that stays constant (no prefill for
thousands of decode steps) is never excited, and its variance grows by 1/lambda every step until
it overflows to inf and the coefficients to NaN ("covariance wind-up"). Every diagonal entry is
therefore held at or below the initial uncertainty by rescaling the whole matrix, and an update
that would leave a non-finite value is dropped (the model keeps what it had).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

NUM_FEATURES = 4
# Features differ by orders of magnitude (1, decodes, prefill tokens, context tokens): RLS runs
# on scaled features so that one initial uncertainty suits them all.
_SCALE = (1.0, 1e-2, 1e-3, 1e-5)


class StepTimeModel:
    """Predicts a step's duration (seconds) from its shape; learns from reported durations."""

    def __init__(
        self,
        *,
        seed_coefficients: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        forgetting: float = 0.98,
        initial_uncertainty: float = 1e4,
        error_window: int = 8,
    ) -> None:
        if len(seed_coefficients) != NUM_FEATURES:
            raise ValueError(f"seed_coefficients needs {NUM_FEATURES} values")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting={forgetting}; use a value in (0, 1]")
        # The RLS state, in scaled units and unclamped; predictions use the clamped projection.
        self._w = [max(float(c), 0.0) / k for c, k in zip(seed_coefficients, _SCALE, strict=True)]
        self.forgetting = forgetting
        n = NUM_FEATURES
        self._p = [[initial_uncertainty if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.max_uncertainty = initial_uncertainty
        self._errors: deque[float] = deque(maxlen=error_window)
        self.num_updates = 0

    @staticmethod
    def features(decode: int, prefill: int, kv_tokens_read: int) -> tuple[float, ...]:
        return (1.0, float(decode), float(prefill), float(kv_tokens_read))

    @property
    def theta(self) -> list[float]:
        """Coefficients (seconds per unit of each feature), clamped non-negative."""
        return [max(w, 0.0) * k for w, k in zip(self._w, _SCALE, strict=True)]

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.theta, x, strict=True))

    def update(self, x: Sequence[float], duration_s: float) -> None:
        """One RLS step; records the relative prediction error made before learning."""
        predicted = self.predict(x)
        if duration_s > 0:
            self._errors.append(abs(predicted - duration_s) / duration_s)
        z = [v * k for v, k in zip(x, _SCALE, strict=True)]
        p, lam = self._p, self.forgetting
        px = [sum(p[i][j] * z[j] for j in range(NUM_FEATURES)) for i in range(NUM_FEATURES)]
        denom = lam + sum(z[i] * px[i] for i in range(NUM_FEATURES))
        gain = [v / denom for v in px]
        error = duration_s - sum(w * v for w, v in zip(self._w, z, strict=True))
        w_new = [w + g * error for w, g in zip(self._w, gain, strict=True)]
        p_new = [
            [(p[i][j] - gain[i] * px[j]) / lam for j in range(NUM_FEATURES)]
            for i in range(NUM_FEATURES)
        ]
        if not all(math.isfinite(v) for v in w_new) or not all(
            math.isfinite(v) for row in p_new for v in row
        ):
            return  # a degenerate sample: keep the last finite state
        largest = max(p_new[i][i] for i in range(NUM_FEATURES))
        if largest > self.max_uncertainty:  # bound the wind-up of unexcited directions
            factor = self.max_uncertainty / largest
            p_new = [[v * factor for v in row] for row in p_new]
        self._w, self._p = w_new, p_new
        self.num_updates += 1

    @property
    def recent_error(self) -> float:
        """Mean relative prediction error over the last steps (0 before any)."""
        return sum(self._errors) / len(self._errors) if self._errors else 0.0
