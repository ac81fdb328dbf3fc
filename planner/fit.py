"""Linear fits of measured times, robust to a noisy shared machine.

Every time the planner uses is a non-negative linear model of a few features (MegaScale-Infer's
T_a = k1 b + k2, T_e = k3 b + k4, extended: KV context read by attention, experts receiving tokens,
bytes per message). Inputs are medians of repeats; the fit minimises relative error (each row
weighted by 1/y, so small and large batches count alike) with coefficients kept >= 0 (a negative
time per token is noise, not physics), and reports its residuals.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fit:
    """y = sum(coef[i] * x[terms[i]]), seconds. Residuals are relative: (fit - y) / y over the
    samples: median absolute, maximum absolute."""

    terms: tuple[str, ...]
    coef: tuple[float, ...]
    median_abs_residual: float
    max_abs_residual: float
    samples: int

    def __call__(self, **x: float | np.ndarray) -> float | np.ndarray:
        return sum(c * (1.0 if t == "const" else x[t]) for t, c in zip(self.terms, self.coef))

    def to_dict(self) -> dict:
        return {"terms": list(self.terms), "coef": list(self.coef), "median_abs_residual": self.median_abs_residual,
                "max_abs_residual": self.max_abs_residual, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: dict) -> "Fit":
        return cls(tuple(d["terms"]), tuple(float(c) for c in d["coef"]), float(d["median_abs_residual"]),
                   float(d["max_abs_residual"]), int(d["samples"]))


def fit_linear(rows: list[dict[str, float]], y: list[float], terms: tuple[str, ...]) -> Fit:
    """Non-negative least squares in relative error of y on the named features of each row
    ("const" is the intercept). Needs at least as many rows as terms."""
    if len(rows) < len(terms):
        raise ValueError(f"fit of {terms} needs at least {len(terms)} samples, got {len(rows)}")
    y_N = np.asarray(y, dtype=np.float64)
    if not (y_N > 0).all():
        raise ValueError("measured times must be positive")
    X_NT = np.array([[1.0 if t == "const" else float(r[t]) for t in terms] for r in rows])
    w_N = 1.0 / y_N
    active = list(range(len(terms)))
    coef_T = np.zeros(len(terms))
    while active:  # drop the most negative coefficient and refit until none is negative
        sol, *_ = np.linalg.lstsq(X_NT[:, active] * w_N[:, None], y_N * w_N, rcond=None)
        if (sol >= 0).all():
            coef_T[:] = 0
            coef_T[active] = sol
            break
        del active[int(np.argmin(sol))]
    rel_N = np.abs(X_NT @ coef_T - y_N) / y_N
    return Fit(tuple(terms), tuple(float(c) for c in coef_T), float(np.median(rel_N)), float(rel_N.max()), len(y_N))
