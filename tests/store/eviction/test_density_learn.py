"""The two implementations of the ``density`` policy's per-key learning
(kvd.store.eviction.density_learn): the native one must leave a policy
exactly where the Python one does, field for field."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvd.io.backend import native_density_learn
from kvd.store.eviction import density as density_module
from kvd.store.eviction.density import DensityPolicy, _DensityNode
from kvd.store.eviction.density_learn import learn_python
from kvd.store.eviction.policy import EvictionPolicy
from tests.store.eviction.support import drain

native = native_density_learn()
needs_native = pytest.mark.skipif(native is None, reason="kvd.io._uring is not built")


def _state(policy: DensityPolicy[Any]) -> dict[str, Any]:
    nodes = {
        key: (node.klass, node.gap, node.tick, node.count, node.due, node.priority, node.seq,
              node.parent, node.hits)
        for key, node in policy._nodes.items()
        if isinstance(node, _DensityNode)
    }  # fmt: skip
    return {
        "nodes": nodes,
        "leaf": sorted(policy._leaf_heap),
        "inner": sorted(policy._inner_heap),
        "ring": bytes(policy._ring_flat),
        "reused": bytes(policy._reused_flat),
        "entered": policy._entered.tobytes(),
        "pending": dict(policy._pending),
        "shares": dict(policy._shares),
        "ghost": list(policy._ghost.items()),
        "retention": list(policy._retention),
        "counters": (policy._seq, policy._accesses, policy._now),
    }


def _drive(policy: EvictionPolicy[Any], seed: int, pool: bool) -> None:
    """Chains that share heads, grow, come back after short and long gaps
    (past the ring's age edges), put or not, evicted under a small
    capacity (the ghost), with every 64th lookup a plan; in a pool, a
    random share of each chain is this member's."""
    rng = random.Random(seed)
    heads = [[(h, i) for i in range(rng.randrange(1, 20))] for h in range(12)]
    capacity = 300
    for step in range(3000):
        head = heads[rng.randrange(len(heads))]
        chain = head + [(100 + step % 97, i) for i in range(rng.randrange(0, 40))]
        if rng.random() < 0.05:
            chain = chain + chain[:3]  # a key twice in one lookup
        mine = [rng.random() < 0.3 for _ in chain] if pool else None
        resident = 0
        for key in chain:
            if key not in policy:
                break
            resident += 1
        policy.touch_many(chain[:resident])
        policy.on_lookup(chain, resident, mine)
        if rng.random() < 0.2:
            continue  # the put never comes: its keys stay announced
        parent = chain[resident - 1] if resident else None
        for position, key in enumerate(chain[resident:], resident):
            if mine is None or mine[position]:
                policy.insert(key, parent)
            parent = key
        while len(policy) > capacity:
            victim = policy.victim(lambda _key: False)
            assert victim is not None
            policy.remove(victim)


@needs_native
@pytest.mark.parametrize(("pool", "negative"), [(False, False), (True, False), (False, True)])
def test_native_learning_matches_python(
    pool: bool, negative: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``negative``: retentions below zero until the policy's first refresh
    (a peer's plan may say anything), so deadlines fall below zero and the
    native priorities take Python's arithmetic instead of their 16 bytes."""
    native_policy: DensityPolicy[Any] = DensityPolicy()
    python_policy: DensityPolicy[Any] = DensityPolicy()
    if negative:
        for policy in (native_policy, python_policy):
            policy._retention = [-1000 - i % 7 for i in range(len(policy._retention))]
    monkeypatch.setattr(density_module, "learn", native)
    _drive(native_policy, 5, pool)
    monkeypatch.setattr(density_module, "learn", learn_python)
    _drive(python_policy, 5, pool)
    got, want = _state(native_policy), _state(python_policy)
    assert got["counters"][2] == 3000  # every lookup learned
    assert want["ghost"] and want["pending"]
    assert not pool or want["shares"]
    for part in want:
        assert got[part] == want[part], part
    assert drain(native_policy) == drain(python_policy)


@needs_native
def test_native_learning_refuses_what_it_cannot_read() -> None:
    assert native is not None
    policy: DensityPolicy[Any] = DensityPolicy()
    policy.insert(b"a", None)
    node = policy._nodes[b"a"]
    assert isinstance(node, _DensityNode)
    node.klass = 10**6  # no class: refused, not read past the ring
    with pytest.raises(ValueError, match="class out of range"):
        policy.on_lookup([b"a", b"b"], 1)
    node.klass = 0
    node.count = "many"  # type: ignore[assignment]
    with pytest.raises(TypeError):
        policy.on_lookup([b"a", b"b"], 1)
