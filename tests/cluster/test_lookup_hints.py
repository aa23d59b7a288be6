"""Lookups answered from the owners' recent answers (``pool_lookup_hint_ms``,
kvd.cluster.hints): a chain looked up again is answered without waiting for
its owners, who are still told of it; a hint gone stale costs a miss at the
get, never wrong bytes or an error, and the miss corrects it; with the
setting at 0 every lookup asks."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from kvd.client import Client
from kvd.cluster import hints as hints_module
from kvd.cluster.hints import Hints
from kvd.cluster.rendezvous import Placement
from kvd.wire.bulk import EXISTS_HELD, EXISTS_KEPT, EXISTS_NOT_HELD
from tests.cluster.cluster import start_static_pool
from tests.sockets import metric, sample
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

CLIENT_TIMEOUT_S = 5.0
HINT_MS = 5_000  # long enough that no hint ages out within a test


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 64


def chain(namespace: str, count: int) -> list[bytes]:
    return [f"{namespace}-block-{i:04d}".encode() for i in range(count)]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    root = tmp_path_factory.mktemp("hints")
    daemons = start_static_pool(root, 3, "--pool-lookup-hint-ms", str(HINT_MS))
    yield daemons
    for daemon in daemons:
        daemon.discard()


def stored_everywhere(pool: list[DaemonProcess], namespace: str, keys: list[bytes]) -> Client:
    """Put ``keys`` through member 0 and wait until each reached its owner
    (before any lookup through another member, whose answers would be kept)."""
    a = Client(pool[0].target, timeout_s=CLIENT_TIMEOUT_S)
    owners = Placement([d.target for d in pool]).owners(namespace, keys)
    forwards = metric(pool[0].metrics_port, "kvd_cluster_forwards_total")
    for key in keys:
        a.put(namespace, key, value_of(key))
    handed_on = sum(owner != pool[0].target for owner in owners)
    assert wait_until(
        lambda: metric(pool[0].metrics_port, "kvd_cluster_forwards_total") >= forwards + handed_on
    )
    return a


def owned_by(pool: list[DaemonProcess], namespace: str, keys: list[bytes], i: int) -> list[int]:
    owners = Placement([d.target for d in pool]).owners(namespace, keys)
    return [p for p, owner in enumerate(owners) if owner == pool[i].target]


def test_a_chain_looked_up_again_is_answered_without_asking(pool: list[DaemonProcess]) -> None:
    keys = chain("again", 60)
    stored_everywhere(pool, "again", keys).close()
    port = pool[1].metrics_port
    with Client(pool[1].target, timeout_s=CLIENT_TIMEOUT_S) as b:
        asked, hinted = (
            sample(port, f"kvd_cluster_{n}_total") for n in ("remote_lookups", "hinted_lookups")
        )
        assert b.lookup("again", keys) == len(keys)  # asks the owners
        assert sample(port, "kvd_cluster_remote_lookups_total") == asked + 1
        told = metric(pool[2].metrics_port, "kvd_cluster_shares_learned_total")
        for _ in range(3):
            assert b.lookup("again", keys) == len(keys)
        assert sample(port, "kvd_cluster_remote_lookups_total") == asked + 1  # none asked since
        assert sample(port, "kvd_cluster_hinted_lookups_total") == hinted + 3
        # The owners still hear of every lookup, for their eviction policies.
        assert owned_by(pool, "again", keys, 2)
        assert wait_until(
            lambda: metric(pool[2].metrics_port, "kvd_cluster_shares_learned_total") >= told + 3
        )
        assert [b.get("again", key) for key in keys] == [value_of(key) for key in keys]


def test_a_stale_hint_costs_a_miss_and_the_miss_corrects_it(pool: list[DaemonProcess]) -> None:
    keys = chain("stale", 60)
    a = stored_everywhere(pool, "stale", keys)
    with a, Client(pool[1].target, timeout_s=CLIENT_TIMEOUT_S) as b:
        assert b.lookup("stale", keys) == len(keys)
        # The owner loses a key after it answered (a delete at the owner, as
        # an eviction would): member 1's hint still says held.
        gone = owned_by(pool, "stale", keys, 2)[0]
        with Client(pool[2].target, timeout_s=CLIENT_TIMEOUT_S) as c:
            assert c.delete("stale", [keys[gone]]) == 1
        a.delete("stale", [keys[gone]])  # member 0's copy, if it still had one
        hinted = sample(pool[1].metrics_port, "kvd_cluster_hinted_lookups_total")
        assert b.lookup("stale", keys) == len(keys)  # claimed from the hint
        assert sample(pool[1].metrics_port, "kvd_cluster_hinted_lookups_total") == hinted + 1
        # The get of it is a miss, never an error or other bytes; the rest read.
        assert b.get("stale", keys[gone]) is None
        others = [k for p, k in enumerate(keys) if p != gone]
        assert [b.get("stale", key) for key in others] == [value_of(key) for key in others]
        # The miss corrected the hint: the chain now ends at the lost key.
        assert b.lookup("stale", keys) == gone


def test_without_hints_every_lookup_asks(tmp_path_factory: pytest.TempPathFactory) -> None:
    daemons = start_static_pool(tmp_path_factory.mktemp("nohints"), 2, "--pool-lookup-hint-ms", "0")
    try:
        keys = chain("asked", 40)
        stored_everywhere(daemons, "asked", keys).close()
        port = daemons[1].metrics_port
        with Client(daemons[1].target, timeout_s=CLIENT_TIMEOUT_S) as b:
            asked = sample(port, "kvd_cluster_remote_lookups_total")
            for _ in range(3):
                assert b.lookup("asked", keys) == len(keys)
            assert sample(port, "kvd_cluster_remote_lookups_total") == asked + 3
            assert sample(port, "kvd_cluster_hinted_lookups_total") == 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_an_owner_keeps_what_it_answered_held_while_the_hint_lasts(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """An owner pins the keys it answered held for the asking member's
    hints (up to an eighth of its L1): puts that evict everything else
    leave them, so the hinted lookup's gets read every block it claimed.
    Past that share a key is answered held but not kept, and asked again."""
    daemons = start_static_pool(
        tmp_path_factory.mktemp("kept"), 2, "--pool-lookup-hint-ms", str(HINT_MS),
        "--dram-bytes", "8MiB", "--max-value-bytes", "64KiB",
    )  # fmt: skip
    try:
        owner, member = daemons
        keys = chain("kept", 400)
        theirs = [keys[p] for p in owned_by(daemons, "kept", keys, 0)]
        kept, past = theirs[:10], theirs[10:40]
        value = bytes(60_000)  # a 64 KiB page each: an eighth of L1 is 16
        with Client(owner.target, timeout_s=CLIENT_TIMEOUT_S) as o:
            o.put_many("kept", [(key, value) for key in kept])
            port = member.metrics_port
            with Client(member.target, timeout_s=CLIENT_TIMEOUT_S) as m:
                assert m.lookup("kept", kept) == len(kept)  # asked: the owner keeps them
                assert metric(owner.metrics_port, "kvd_cluster_hints_kept_total") == len(kept)
                assert metric(owner.metrics_port, "kvd_cluster_hint_pinned_bytes") >= 10 * 60_000
                # More than the owner's L1 of its own fresh values: they evict all else.
                fresh = [keys[p] for p in owned_by(daemons, "churn", keys, 0)][:200]
                o.put_many("churn", [(key, value) for key in fresh])
                hinted = sample(port, "kvd_cluster_hinted_lookups_total")
                assert m.lookup("kept", kept) == len(kept)
                assert sample(port, "kvd_cluster_hinted_lookups_total") == hinted + 1
                assert m.get_many("kept", kept) == [value] * len(kept)
                assert metric(port, "kvd_cluster_remote_misses_total") == 0
                # Past the owner's share: held, not kept, no hint; asked each time.
                o.put_many("kept", [(key, value) for key in past])
                asked = sample(port, "kvd_cluster_remote_lookups_total")
                for _ in range(2):
                    assert m.lookup("kept", past) == len(past)
                assert sample(port, "kvd_cluster_remote_lookups_total") == asked + 2
                assert metric(owner.metrics_port, "kvd_cluster_hints_not_kept_total") > 0
    finally:
        for daemon in daemons:
            daemon.discard()


def test_an_owners_pins_for_hints_end_by_themselves(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """What an owner keeps for a member's hints is pinned for twice the
    setting plus the peer timeout, then let go though nobody asks again:
    no lookup leaves pages pinned for ever."""
    hint_ms, peer_timeout_ms = 200, 200
    daemons = start_static_pool(
        tmp_path_factory.mktemp("ending"), 2, "--pool-lookup-hint-ms", str(hint_ms),
        peer_timeout_ms=peer_timeout_ms,
    )  # fmt: skip
    try:
        owner, member = daemons
        keys = chain("ending", 200)
        theirs = [keys[p] for p in owned_by(daemons, "ending", keys, 0)][:20]
        with Client(owner.target, timeout_s=CLIENT_TIMEOUT_S) as o:
            o.put_many("ending", [(key, value_of(key)) for key in theirs])
        pinned = "kvd_cluster_hint_pinned_bytes"
        with Client(member.target, timeout_s=CLIENT_TIMEOUT_S) as m:
            asked = time.monotonic()
            assert m.lookup("ending", theirs) == len(theirs)
        assert metric(owner.metrics_port, pinned) > 0
        life_s = (2 * hint_ms + peer_timeout_ms) / 1000
        assert wait_until(lambda: metric(owner.metrics_port, pinned) == 0, timeout_s=5 * life_s)
        assert time.monotonic() - asked >= life_s  # not before the member's hints could end
    finally:
        for daemon in daemons:
            daemon.discard()


def test_a_chain_looked_up_again_and_again_keeps_fresh_hints_without_waiting(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """While a chain is looked up (an engine's waiting request, every step),
    its owners are asked again in the background every quarter of the
    setting: no lookup waits for them once the hints' life has passed, and
    a key stored at its owner since it answered "not held" is found within
    that quarter, not the hint's whole life."""
    hint_ms = 2000
    daemons = start_static_pool(
        tmp_path_factory.mktemp("fresh"), 2, "--pool-lookup-hint-ms", str(hint_ms)
    )
    try:
        owner, member = daemons
        keys = chain("fresh", 200)
        theirs = [keys[p] for p in owned_by(daemons, "fresh", keys, 0)][:40]
        port = member.metrics_port
        with (
            Client(owner.target, timeout_s=CLIENT_TIMEOUT_S) as o,
            Client(member.target, timeout_s=CLIENT_TIMEOUT_S) as m,
        ):
            o.put_many("fresh", [(key, value_of(key)) for key in theirs[:20]])
            refreshes = sample(port, "kvd_cluster_hint_refreshes_total")
            assert m.lookup("fresh", theirs) == 20  # asks the owner
            asked = sample(port, "kvd_cluster_remote_lookups_total")
            # Past the hints' longest life, looked up every 50 ms: never asked again.
            until = time.monotonic() + 2.5 * hint_ms / 1000
            while time.monotonic() < until:
                assert m.lookup("fresh", theirs) == 20
                time.sleep(0.05)
            assert sample(port, "kvd_cluster_remote_lookups_total") == asked
            assert sample(port, "kvd_cluster_hint_refreshes_total") >= refreshes + 4
            # The rest of the chain lands at its owner: found within a quarter
            # of the setting and a round trip (a hint alone: 2 to 4 s).
            o.put_many("fresh", [(key, value_of(key)) for key in theirs[20:]])
            stored = time.monotonic()
            while m.lookup("fresh", theirs) < len(theirs):
                assert time.monotonic() - stored < 0.75 * hint_ms / 1000
                time.sleep(0.02)
            assert sample(port, "kvd_cluster_remote_lookups_total") == asked
            assert [m.get("fresh", key) for key in theirs] == [value_of(key) for key in theirs]
    finally:
        for daemon in daemons:
            daemon.discard()


# ---- Hints itself ----------------------------------------------------------------


def test_hints_settle_a_chain_only_when_every_key_before_its_end_has_an_answer() -> None:
    hints = Hints(60.0)
    keys = [b"k0", b"k1", b"k2", b"k3"]
    here = [True, False, False, False]
    assert hints.settle("ns", keys, here) is None  # nothing known of k1
    hints.note("ns", [b"k1", b"k2"], [True, False])
    assert hints.settle("ns", keys, here) == 2  # k0 here, k1 held, k2 not: the end
    assert hints.settle("other", keys, here) is None  # namespaces apart
    hints.note("ns", [b"k2", b"k3"], [True, True])
    assert hints.settle("ns", keys, here) == 4
    hints.forget("ns", b"k3")
    assert hints.settle("ns", keys, here) is None
    hints.note("ns", [b"k3"], [True])
    hints.clear()
    assert hints.of("ns", keys) == [None] * 4 and len(hints) == 0
    assert not Hints(0.0).enabled


def test_only_keys_their_owner_keeps_are_hinted_held() -> None:
    hints = Hints(60.0)
    keys = [b"k0", b"k1", b"k2", b"k3"]
    hints.note_answers("ns", keys, bytes([EXISTS_KEPT, EXISTS_NOT_HELD, EXISTS_KEPT, EXISTS_KEPT]))
    assert hints.of("ns", keys) == [True, False, True, True]
    # Held but not kept (or a kind of answer this daemon does not know): no new hint.
    hints.note_answers("other", keys, bytes([EXISTS_KEPT, EXISTS_HELD, EXISTS_NOT_HELD, 7]))
    assert hints.of("other", keys) == [True, None, False, None]
    assert hints.settle("other", keys, [False] * 4) is None  # k1 is asked


def test_hints_last_between_their_ttl_and_twice_it() -> None:
    ttl = 0.2
    hints = Hints(ttl)
    hints.note("ns", [b"a"], [True])
    time.sleep(ttl * 1.2)
    hints.note("ns", [b"b"], [False])  # the first generation turns: a is kept
    assert hints.of("ns", [b"a", b"b"]) == [True, False]
    time.sleep(ttl * 1.2)  # a's generation began over twice ttl ago
    assert hints.of("ns", [b"a", b"b"]) == [None, False]
    time.sleep(ttl * 2.2)
    assert hints.of("ns", [b"a", b"b"]) == [None, None]


def test_hints_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hints_module, "HINTS_MAX", 100)
    hints = Hints(60.0)
    for i in range(50):
        hints.note("ns", [b"%d-%d" % (i, j) for j in range(10)], [True] * 10)
        assert len(hints) <= 2 * 100
    assert hints.of("ns", [b"49-0"]) == [True]  # the newest are kept
    assert hints.of("ns", [b"0-0"]) == [None]
