"""The ``density`` policy's plan: a retention per class of reference, from
the counts of references that entered and were reused in each age bin
(``DensityPolicy._refresh``, every 64 lookups).

``proportional_hazards`` turns the counts into a reuse hazard per class and
age bin; ``choose`` makes the plan from them. A retention R earns a class
its share reused within R (``gain``) and costs the lookups a reference
stays (``cost``); each class takes the R that maximises ``gain - lambda *
cost``, and ``log_lambda`` bisects lambda so that the planned occupancy
fills the blocks tracked.

In numpy a plan took 0.35 ms hot and ~0.4-0.6 ms in the daemon, where it
runs cold once every 64 lookups (the hazards ~0.08 ms hot, the bisection's
30 steps of seven array calls each ~0.17, the rest some 25 array calls),
and a plan is made inside a lookup's learning, so that lookup's successor
waited for it. ``kvd.io._uring.density_hazards`` and ``density_choose``
(native/kvd_plan.c) do the same with numpy's own arithmetic (its exp, its
rounding, its argmax, its sums' order) and Python's ``min`` and ``max``,
so the plans are the same to the bit; the functions here use them where
they are built, and tests run both ways on the same counts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvd.io.backend import native_density_choose, native_density_hazards

# Prior weight (references) of each hazard factor, as in ``hazard``.
_PRIOR_WEIGHT = 20.0
_FEATURE_ROUNDS = 4

Floats = npt.NDArray[np.float64]


def proportional_hazards_python(
    entered: Floats, reused: Floats, features: tuple[npt.NDArray[np.int64], ...]
) -> Floats:
    """Reuse hazard per class and age bin: the pooled hazard times a class
    factor, the product of one factor per feature value (observed /
    expected reuses, a few rounds) times the class's own residual; every
    ratio has _PRIOR_WEIGHT on both sides, so a rare class follows its
    features and a rare feature value the pooled hazard."""
    classes, bins = entered.shape
    pooled_entered = entered.sum(axis=0)
    pooled = np.divide(
        reused.sum(axis=0), pooled_entered, out=np.zeros(bins), where=pooled_entered > 0.0
    )
    expected = (entered * pooled).sum(axis=1)
    observed = reused.sum(axis=1)
    factor = np.ones(classes)
    # Per feature value at once: observed over expected reuses of its classes.
    observed_by = [np.bincount(feature, weights=observed) for feature in features]
    for _ in range(_FEATURE_ROUNDS):
        for feature, seen in zip(features, observed_by, strict=True):
            ratio = (seen + _PRIOR_WEIGHT) / (
                np.bincount(feature, weights=expected * factor) + _PRIOR_WEIGHT
            )
            factor *= ratio[feature]
    factor *= (observed + _PRIOR_WEIGHT) / (factor * expected + _PRIOR_WEIGHT)
    hazard: Floats = np.clip(factor[:, None] * pooled[None, :], 0.0, 1.0)
    return hazard


def log_lambda(
    gain: Floats, cost: Floats, occupancy: Floats, target: float,
    low: float, high: float, steps: int,
) -> float:  # fmt: skip
    """The upper end of log(lambda)'s range after ``steps`` halvings: the
    planned occupancy at lambda = exp(high) is at most ``target``, at
    exp(low) above it. ``occupancy`` is the table of ``cost``'s shape
    flattened (each choice's lookups kept per lookup)."""
    at_row = np.arange(cost.shape[0]) * cost.shape[1]
    value = np.empty_like(cost)  # gain - lambda * cost, in place
    for _ in range(steps):
        middle = (low + high) / 2.0
        np.subtract(gain, np.multiply(cost, np.exp(middle), out=value), out=value)
        if float(occupancy[at_row + value.argmax(axis=1)].sum()) > target:
            low = middle
        else:
            high = middle
    return high


def tables(
    hazard: Floats, entered: Floats, widths: Floats, lookups: float
) -> tuple[Floats, Floats, Floats, Floats, Floats]:
    """What a plan is chosen from: the survival per class and age bin; per
    class and retention (0, then each age edge) the share reused within it
    (gain) and the lookups a reference stays (cost); the lookups kept per
    lookup by each choice (occupancy, flattened); references per lookup
    per class (scale)."""
    classes = hazard.shape[0]
    survival = np.cumprod(1.0 - hazard, axis=1, dtype=np.float64)
    before = np.concatenate([np.ones((classes, 1)), survival[:, :-1]], axis=1)
    zeros = np.zeros((classes, 1))
    gain = np.concatenate([zeros, 1.0 - survival], axis=1)
    cost = np.concatenate([zeros, np.cumsum(before * widths, axis=1)], axis=1)
    scale = entered[:, 0] / lookups
    occupancy = (scale[:, None] * cost).ravel()
    return survival, gain, cost, occupancy, scale


def choose_python(
    hazard: Floats, entered: Floats, widths: Floats, retentions: Floats, lookups: float,
    target: float, bounds: tuple[float, float], steps: int, residence_cap: float,
) -> tuple[list[int], Floats]:  # fmt: skip
    """The plan from the hazards: a retention per class (each class's best
    gain - lambda * cost, lambda bisected on its log within ``bounds`` so
    that the planned occupancy fills ``target`` blocks, capped at
    ``residence_cap`` mean residences), and the survival per class and age
    bin. ``retentions`` are the choices (0, then the age edges), ``widths``
    the age bins' widths."""
    survival, gain, cost, occupancy, scale = tables(hazard, entered, widths, lookups)
    high = log_lambda(gain, cost, occupancy, target, *bounds, steps)
    choice = np.argmax(gain - np.exp(high) * cost, axis=1)
    # Mean residence if every reference took a slot, in lookups.
    residence = target / max(float(scale.sum()), 1e-9)
    cap = residence_cap * residence
    return [int(min(r, cap)) for r in retentions[choice]], survival


def _choose_native(
    native: Callable[..., list[int]],
) -> Callable[..., tuple[list[int], Floats]]:
    def choose(
        hazard: Floats, entered: Floats, widths: Floats, retentions: Floats, lookups: float,
        target: float, bounds: tuple[float, float], steps: int, residence_cap: float,
    ) -> tuple[list[int], Floats]:  # fmt: skip
        survival: Floats = np.empty_like(hazard)
        low, high = bounds
        plan = native(hazard, entered, widths, retentions, lookups, target, low, high, steps,
                      residence_cap, np.exp, survival)  # fmt: skip
        return plan, survival

    return choose


def _hazards_native(
    native: Callable[..., None],
) -> Callable[[Floats, Floats, tuple[npt.NDArray[np.int64], ...]], Floats]:
    def proportional_hazards(
        entered: Floats, reused: Floats, features: tuple[npt.NDArray[np.int64], ...]
    ) -> Floats:
        classes, bins = entered.shape
        hazard: Floats = np.empty((classes, bins))
        native(entered, reused, features, classes, bins, _PRIOR_WEIGHT, _FEATURE_ROUNDS, hazard)
        return hazard

    return proportional_hazards


_native_hazards = native_density_hazards()
proportional_hazards = (
    _hazards_native(_native_hazards) if _native_hazards is not None else proportional_hazards_python
)
_native_choose = native_density_choose()
choose = _choose_native(_native_choose) if _native_choose is not None else choose_python
