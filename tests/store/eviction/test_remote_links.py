"""Children on other pool members (``link_remote`` / ``unlink_remote``,
kvd.store.eviction.chains): a block whose child lives on another member is
not a leaf while the link lasts, in every policy; links are idempotent and
bounded, the oldest forgotten first."""

from __future__ import annotations

import pytest

from kvd.store.eviction import chains
from kvd.store.eviction.policy import POLICIES, make_policy
from tests.store.eviction.support import drain, insert_chain


@pytest.mark.parametrize("name", POLICIES)
def test_a_block_with_a_remote_child_goes_after_the_leaves(name: str) -> None:
    policy = make_policy(name)
    insert_chain(policy, ["a1", "a2"])
    insert_chain(policy, ["b1", "b2"])
    policy.link_remote("a3", "a2")  # a2's child lives on another member
    order = drain(policy)
    assert set(order) == {"a1", "a2", "b1", "b2"}
    # The b chain goes first, leaf first: a2 is no leaf while its remote
    # child lasts, so neither it nor a1 may go while b has a leaf.
    assert order[:2] == ["b2", "b1"]


@pytest.mark.parametrize("name", POLICIES)
def test_unlinking_makes_the_parent_a_leaf_again(name: str) -> None:
    policy = make_policy(name)
    insert_chain(policy, ["a1", "a2"])
    insert_chain(policy, ["b1", "b2"])
    policy.link_remote("a3", "a2")
    policy.link_remote("a3", "a2")  # told twice: still one child
    policy.unlink_remote("a3")
    policy.unlink_remote("a3")  # and a no-op now
    policy.unlink_remote("never-linked")
    # With the b chain pinned, the a chain goes tail first again: a2 is a
    # leaf (linked, it would not be, and the older a1 would go first).
    assert policy.victim(lambda key: key.startswith("b")) == "a2"
    assert "a2" not in policy._children  # type: ignore[attr-defined]


def test_a_parent_linked_before_it_arrives_is_no_leaf() -> None:
    policy = make_policy("lru")
    policy.link_remote("x2", "x1")  # the child was put on its member first
    insert_chain(policy, ["x1"])
    insert_chain(policy, ["y1"])
    assert drain(policy) == ["y1", "x1"]


def test_links_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chains, "REMOTE_LINKS_MIN", 0)
    policy = make_policy("lru")
    insert_chain(policy, ["p1"])
    insert_chain(policy, ["p2"])
    for i, parent in enumerate(["p1", "p2", "p1", "p2", "p1"]):
        policy.link_remote(f"c{i}", parent)
    # Two links per tracked block (2 blocks) are kept: c0 was forgotten,
    # p1 still has c2 and c4, p2 has c1 and c3.
    assert len(policy._remote) == 4  # type: ignore[attr-defined]
    assert "c0" not in policy._remote  # type: ignore[attr-defined]
    for child in ("c1", "c2", "c3", "c4"):
        policy.unlink_remote(child)
    assert policy._children == {}  # type: ignore[attr-defined]
