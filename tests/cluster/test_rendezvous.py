"""Rendezvous placement: stable, spread evenly, and a join or leave moves
only the share of the member that joined or left (~1/N of the keys)."""

from __future__ import annotations

import collections

import pytest

from kvd.cluster.rendezvous import Placement

KEYS = [b"block-%06d" % i for i in range(20_000)]


def members(count: int) -> list[str]:
    return [f"10.0.0.{i}:7070" for i in range(1, count + 1)]


def test_same_owner_whatever_the_member_order() -> None:
    forward = Placement(members(5))
    backward = Placement(list(reversed(members(5))))
    assert forward.owners("ns", KEYS[:500]) == backward.owners("ns", KEYS[:500])


def test_keys_spread_evenly() -> None:
    placement = Placement(members(4))
    counts = collections.Counter(placement.owners("ns", KEYS))
    assert set(counts) == set(members(4))
    for count in counts.values():  # 5,000 each expected; binomial sd is ~61
        assert abs(count - len(KEYS) / 4) < 0.05 * len(KEYS)


def test_namespace_is_part_of_the_placement() -> None:
    placement = Placement(members(4))
    assert placement.owners("a", KEYS[:200]) != placement.owners("b", KEYS[:200])


@pytest.mark.parametrize("before", [3, 4, 8])
def test_join_moves_only_the_new_members_share(before: int) -> None:
    old = Placement(members(before))
    new = Placement(members(before + 1))
    joined = members(before + 1)[-1]
    old_owners = old.owners("ns", KEYS)
    new_owners = new.owners("ns", KEYS)
    moved = [i for i in range(len(KEYS)) if old_owners[i] != new_owners[i]]
    # Every key that moved went to the new member; none moved between old ones.
    assert all(new_owners[i] == joined for i in moved)
    share = len(moved) / len(KEYS)
    ideal = 1 / (before + 1)
    print(f"join {before}->{before + 1}: {share:.4f} of keys moved (1/N = {ideal:.4f})")
    assert share <= 1.2 * ideal
    assert share >= 0.8 * ideal


@pytest.mark.parametrize("before", [4, 5])
def test_leave_moves_only_the_leavers_keys(before: int) -> None:
    old = Placement(members(before))
    left = members(before)[1]
    new = Placement([m for m in members(before) if m != left])
    old_owners = old.owners("ns", KEYS)
    new_owners = new.owners("ns", KEYS)
    moved = [i for i in range(len(KEYS)) if old_owners[i] != new_owners[i]]
    assert all(old_owners[i] == left for i in moved)
    assert len(moved) == old_owners.count(left)
    share = len(moved) / len(KEYS)
    print(f"leave {before}->{before - 1}: {share:.4f} of keys moved (1/N = {1 / before:.4f})")
    assert share <= 1.2 / before
