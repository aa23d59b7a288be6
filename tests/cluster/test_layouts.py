"""Chain layouts remembered per chain (kvd.cluster.layouts): the same
layout as laid out afresh, each chain laid out once, keys of mixed widths
never remembered, all forgotten with the placement, at most LAYOUTS_MAX."""

from __future__ import annotations

import pytest

from kvd.cluster import layouts as layouts_module
from kvd.cluster.layouts import Layouts
from kvd.cluster.rendezvous import Placement

MEMBERS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def test_a_chain_is_laid_out_once_and_as_the_placement_says() -> None:
    placement = Placement(MEMBERS)
    asked: list[int] = []

    def owners_of(namespace: str, keys: list[bytes]) -> list[str]:
        asked.append(len(keys))
        return [placement.owner(namespace, key) for key in keys]

    layouts = Layouts(owners_of)
    keys = [b"key-%04d" % i for i in range(200)]
    me = MEMBERS[0]
    first = layouts.of("ns", keys, me, placement)
    owners = [placement.owner("ns", key) for key in keys]
    assert first.owners == owners and first.mine == [o == me for o in owners]
    assert set(first.shares) == set(owners) - {me}
    for owner, positions in first.shares.items():
        assert positions == [i for i, o in enumerate(owners) if o == owner]
    assert layouts.of("ns", list(keys), me, placement) is first  # equal keys, new objects
    assert layouts.of("other", keys, me, placement) is not first  # namespaces apart
    assert asked == [200, 200]
    mixed = [b"a", b"bb", *keys]
    layouts.of("ns", mixed, me, placement)
    layouts.of("ns", mixed, me, placement)
    assert asked == [200, 200, 202, 202]  # mixed widths: laid out each time
    moved = Placement(MEMBERS[:2])
    assert layouts.of("ns", keys, me, moved) is not first  # a new placement, a new layout


def test_layouts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts_module, "LAYOUTS_MAX", 4)
    placement = Placement(MEMBERS)
    layouts = Layouts(lambda ns, keys: [placement.owner(ns, k) for k in keys])
    chains = [[b"c%d-%d" % (c, i) for i in range(5)] for c in range(6)]
    kept = [layouts.of("ns", chain, MEMBERS[0], placement) for chain in chains]
    assert len(layouts) == 4
    assert layouts.of("ns", chains[-1], MEMBERS[0], placement) is kept[-1]
    assert layouts.of("ns", chains[0], MEMBERS[0], placement) is not kept[0]
