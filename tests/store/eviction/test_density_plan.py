"""The ``density`` policy's plan (kvd.store.eviction.density_plan): its
hazards and bisection in C (native/kvd_plan.c) against numpy's, on the
same counts and tables, to the bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvd.io.backend import native_density_choose, native_density_hazards, native_density_lambda
from kvd.store.eviction.density import (
    _BINS,
    _BISECT_STEPS,
    _CLASSES,
    _FEATURES,
    _LOG_LAMBDA,
    _REFRESH,
    _RESIDENCE_CAP,
    _RETENTIONS,
    _WIDTHS,
)
from kvd.store.eviction.density_plan import (
    Floats,
    choose,
    choose_python,
    log_lambda_python,
    proportional_hazards,
    proportional_hazards_python,
)
from tests.store.eviction.support import planned

native = native_density_lambda()
native_hazards = native_density_hazards()
native_choose = native_density_choose()
needs_native = pytest.mark.skipif(
    native is None or native_hazards is None or native_choose is None,
    reason="kvd.io._uring is not built",
)
STEPS = 30


def _tables(rng: np.random.Generator, classes: int, columns: int) -> tuple[Floats, Floats, Floats]:
    """gain, cost and occupancy shaped as a plan makes them: survival falling
    along each row, costs summed, classes of very different weights."""
    hazard = rng.random((classes, columns - 1)) ** rng.uniform(0.5, 8.0)
    survival = np.cumprod(1.0 - hazard, axis=1)
    zeros = np.zeros((classes, 1))
    gain = np.concatenate([zeros, 1.0 - survival], axis=1)
    widths = np.diff(np.concatenate([[0.0], rng.uniform(1, 2, columns - 1).cumsum() ** 2]))
    before = np.concatenate([np.ones((classes, 1)), survival[:, :-1]], axis=1)
    cost = np.concatenate([zeros, np.cumsum(before * widths, axis=1)], axis=1)
    scale = rng.random(classes) * 10.0 ** rng.integers(-4, 3, classes)
    scale[rng.random(classes) < 0.2] = 0.0  # classes never seen
    return gain, cost, (scale[:, None] * cost).ravel()


def _native(gain: Floats, cost: Floats, occupancy: Floats, target: float) -> float:
    assert native is not None
    classes, columns = cost.shape
    return native(gain, cost, occupancy, classes, columns, target, -20.0, 5.0, STEPS, np.exp)


@needs_native
def test_native_bisection_ends_where_numpys_does() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        gain, cost, occupancy = _tables(rng, int(rng.integers(1, 140)), int(rng.integers(2, 50)))
        at_row = np.arange(cost.shape[0]) * cost.shape[1]
        # Targets at the occupancy of some lambda, to the bit: a sum rounded
        # any other way than numpy's goes the other way there.
        lam = np.exp(rng.uniform(-20.0, 5.0))
        exact = float(occupancy[at_row + (gain - lam * cost).argmax(axis=1)].sum())
        for target in (exact, float(occupancy.sum()) * rng.random(), 0.0, 1e300):
            python = log_lambda_python(gain, cost, occupancy, target, -20.0, 5.0, STEPS)
            assert _native(gain, cost, occupancy, target) == python


@needs_native
def test_native_bisection_takes_numpys_argmax_on_ties_and_nans() -> None:
    gain = np.array([[0.0, 0.5, 0.5, 0.2], [0.0, np.nan, 0.9, np.nan], [0.0, 0.0, 0.0, 0.0]])
    cost = np.array([[0.0, 1.0, 1.0, 3.0], [0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    occupancy = (np.array([1.0, 2.0, 3.0])[:, None] * cost + np.arange(12).reshape(3, 4)).ravel()
    for target in (0.5, 5.0, 9.0, 12.0, 100.0):
        python = log_lambda_python(gain, cost, occupancy, target, -20.0, 5.0, STEPS)
        assert _native(gain, cost, occupancy, target) == python


@needs_native
def test_native_bisection_refuses_bad_tables() -> None:
    gain, cost, occupancy = _tables(np.random.default_rng(1), 4, 5)
    assert native is not None
    with pytest.raises(TypeError):
        native(gain.astype(np.float32), cost, occupancy, 4, 5, 1.0, -20.0, 5.0, STEPS, np.exp)
    with pytest.raises(ValueError):
        native(gain, cost, occupancy[:-1], 4, 5, 1.0, -20.0, 5.0, STEPS, np.exp)
    with pytest.raises(ValueError):
        native(gain, cost, occupancy, 0, 5, 1.0, -20.0, 5.0, STEPS, np.exp)
    with pytest.raises(ZeroDivisionError):  # exp's error comes through

        def bad_exp(x: float) -> float:
            raise ZeroDivisionError

        native(gain, cost, occupancy, 4, 5, 1.0, -20.0, 5.0, STEPS, bad_exp)


@needs_native
def test_native_hazards_are_numpys() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        entered, reused = _counts(rng)
        python = proportional_hazards_python(entered, reused, _FEATURES)
        assert proportional_hazards(entered, reused, _FEATURES).tobytes() == python.tobytes()
    zero = np.zeros((_CLASSES, _BINS))  # nothing counted yet
    assert proportional_hazards(zero, zero, _FEATURES).tobytes() == (
        proportional_hazards_python(zero, zero, _FEATURES).tobytes()
    )


@needs_native
def test_native_hazards_refuse_bad_features_and_tables() -> None:
    assert native_hazards is not None
    table = np.zeros((_CLASSES, _BINS))
    out = np.empty((_CLASSES, _BINS))

    def call(features: tuple[object, ...], hazard: object = out, bins: int = _BINS) -> None:
        assert native_hazards is not None
        native_hazards(table, table, features, _CLASSES, bins, 20.0, 4, hazard)

    call(_FEATURES)
    with pytest.raises(TypeError):
        call((_FEATURES[0].astype(np.int32),))
    with pytest.raises(TypeError):
        call((_FEATURES[0][:-1],))
    with pytest.raises(ValueError):
        call((np.full(_CLASSES, -1, dtype=np.int64),))
    with pytest.raises(ValueError):
        call((np.full(_CLASSES, _CLASSES, dtype=np.int64),))
    with pytest.raises(ValueError):
        call(_FEATURES, bins=_BINS - 1)
    with pytest.raises(TypeError):
        call(_FEATURES, hazard=out.tobytes())  # read-only


def _counts(rng: np.random.Generator) -> tuple[Floats, Floats]:
    """Reference counts per class and age bin, as a policy's (halved) ones."""
    entered = np.floor(rng.random((_CLASSES, _BINS)) * 10.0 ** rng.integers(0, 6))
    entered *= rng.random((_CLASSES, _BINS)) < rng.random()  # sparse rows and columns
    reused = np.floor(entered * rng.random((_CLASSES, _BINS))) / 2.0 ** rng.integers(0, 8)
    return entered / 2.0 ** rng.integers(0, 8), reused


@needs_native
def test_native_plan_is_numpys() -> None:
    rng = np.random.default_rng(9)
    for _ in range(150):
        entered, reused = _counts(rng)
        hazard = proportional_hazards(entered, reused, _FEATURES)
        lookups = float(rng.uniform(0.5, 5000.0))
        for target in (float(rng.integers(1, 200_000)), 0.0, 1e15):
            args = (hazard, entered, _WIDTHS, _RETENTIONS, lookups, target, _LOG_LAMBDA,
                    _BISECT_STEPS, _RESIDENCE_CAP)  # fmt: skip
            plan, survival = choose(*args)
            python_plan, python_survival = choose_python(*args)
            assert plan == python_plan
            assert survival.tobytes() == python_survival.tobytes()


@needs_native
def test_native_plan_refuses_tables_of_another_size() -> None:
    assert native_choose is not None
    hazard = np.zeros((_CLASSES, _BINS))
    survival = np.empty_like(hazard)

    def call(**change: Any) -> None:
        assert native_choose is not None
        args: dict[str, Any] = {
            "hazard": hazard, "entered": hazard, "widths": _WIDTHS, "retentions": _RETENTIONS,
            "survival": survival,
        } | change  # fmt: skip
        native_choose(args["hazard"], args["entered"], args["widths"], args["retentions"],
                      1.0, 10.0, -20.0, 5.0, 30, 4.0, np.exp, args["survival"])  # fmt: skip

    call()
    for bad in (
        {"entered": hazard[:-1]},
        {"retentions": _RETENTIONS[:-1]},
        {"widths": _WIDTHS[:0]},
        {"survival": survival.tobytes()},
    ):
        with pytest.raises((ValueError, TypeError)):
            call(**bad)


def test_a_member_keeping_anothers_plan_makes_its_own_only_when_asked() -> None:
    holder = planned("holder", 4)
    member, twin = planned("member", 9, lookups=320), planned("member", 9, lookups=320)
    plan = holder.shared_plan()
    assert plan is not None and member.adopt_plan(plan)
    made: list[int] = []
    own = member._plan

    def counted() -> Any:
        made.append(1)
        return own()

    member._plan = counted  # type: ignore[method-assign]
    for _ in range(2 * _REFRESH):  # two plans due while the holder's is kept
        member.on_lookup([], 0, [])
        twin.on_lookup([], 0, [])
    assert not made
    # Asked, it plans from its counts now: what its twin planned at the lookup.
    assert member.shared_plan() == twin.shared_plan() and len(made) == 1
    assert member.shared_plan() == twin.shared_plan() and len(made) == 1  # made once
    retention = [member.retention(c) for c in range(_CLASSES)]
    assert retention == [holder.retention(c) for c in range(_CLASSES)]  # still the holder's


@needs_native
def test_policies_plan_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = planned("a", 5, lookups=2 * _REFRESH + 1)
    with_native = [policy.retention(c) for c in range(_CLASSES)]
    monkeypatch.setattr("kvd.store.eviction.density.choose", choose_python)
    monkeypatch.setattr("kvd.store.eviction.density_plan.log_lambda", log_lambda_python)
    monkeypatch.setattr(
        "kvd.store.eviction.density.proportional_hazards", proportional_hazards_python
    )
    policy = planned("a", 5, lookups=2 * _REFRESH + 1)
    assert [policy.retention(c) for c in range(_CLASSES)] == with_native
