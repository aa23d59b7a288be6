"""The ``density`` policy's plan (kvd.store.eviction.density_plan): its
hazards and its choice with the bisection in C (native/kvd_plan.c)
against numpy's, on the same counts, to the bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvd.io.backend import native_density_choose, native_density_hazards
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
    proportional_hazards,
    proportional_hazards_python,
    tables,
)
from tests.store.eviction.support import planned

native_hazards = native_density_hazards()
native_choose = native_density_choose()
needs_native = pytest.mark.skipif(
    native_hazards is None or native_choose is None, reason="kvd.io._uring is not built"
)


def _hazard(rng: np.random.Generator) -> Floats:
    """Hazards shaped as a plan's: classes of very different reuse."""
    hazard: Floats = rng.random((_CLASSES, _BINS)) ** rng.uniform(0.5, 8.0, (_CLASSES, 1))
    return hazard


def _both(hazard: Floats, entered: Floats, lookups: float, target: float) -> None:
    """The plan and survival in C are numpy's, to the bit."""
    args = (hazard, entered, _WIDTHS, _RETENTIONS, lookups, target, _LOG_LAMBDA,
            _BISECT_STEPS, _RESIDENCE_CAP)  # fmt: skip
    plan, survival = choose(*args)
    python_plan, python_survival = choose_python(*args)
    assert plan == python_plan
    assert survival.tobytes() == python_survival.tobytes()


@needs_native
def test_native_bisection_ends_where_numpys_does() -> None:
    rng = np.random.default_rng(7)
    for _ in range(300):
        hazard = _hazard(rng)
        entered = rng.random((_CLASSES, _BINS)) * 10.0 ** rng.integers(-4, 3, (_CLASSES, 1))
        entered[rng.random(_CLASSES) < 0.2] = 0.0  # classes never seen
        lookups = float(rng.uniform(0.5, 5000.0))
        _, gain, cost, occupancy, _ = tables(hazard, entered, _WIDTHS, lookups)
        at_row = np.arange(_CLASSES) * cost.shape[1]
        # A target at the occupancy of some lambda, to the bit: a sum rounded
        # any other way than numpy's goes the other way there.
        lam = np.exp(rng.uniform(*_LOG_LAMBDA))
        exact = float(occupancy[at_row + (gain - lam * cost).argmax(axis=1)].sum())
        for target in (exact, float(occupancy.sum()) * rng.random(), 0.0, 1e300):
            _both(hazard, entered, lookups, target)


@needs_native
def test_native_plan_takes_numpys_argmax_on_ties_and_nans() -> None:
    rng = np.random.default_rng(3)
    hazard = _hazard(rng)
    hazard[::5] = 1.0  # nothing survives a bin: every retention ties on gain and cost
    hazard[1::7, 10:] = np.nan
    entered = rng.random((_CLASSES, _BINS)) * 100.0
    for target in (0.5, 50.0, 5_000.0, 1e6, 1e12):
        _both(hazard, entered, 10.0, target)


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
            _both(hazard, entered, lookups, target)


@needs_native
def test_native_plan_refuses_bad_tables() -> None:
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
                      1.0, 10.0, -20.0, 5.0, 30, 4.0, args.get("exp", np.exp),
                      args["survival"])  # fmt: skip

    def bad_exp(x: float) -> float:
        raise ZeroDivisionError

    call()
    with pytest.raises(ZeroDivisionError):  # exp's error comes through
        call(exp=bad_exp)
    for bad in (
        {"hazard": hazard.astype(np.float32)},
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
    monkeypatch.setattr(
        "kvd.store.eviction.density.proportional_hazards", proportional_hazards_python
    )
    policy = planned("a", 5, lookups=2 * _REFRESH + 1)
    assert [policy.retention(c) for c in range(_CLASSES)] == with_native
