"""Guests (kvd.store.entries): a pool member's copies of values other members
own stay out of the eviction policy, go first (oldest first, pinned ones
skipped) and are not written to L2 unless a put is durable; and a member's
policy learns of a chain only the keys it owns (``ChainShares.learn_chain``,
``Store.lookup``'s ``mine``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvd.io.backend import open_backend
from kvd.l1.pool import PAGE_BYTES, Pool
from kvd.l2.tier import L2Tier
from kvd.store.eviction.policy import make_policy
from kvd.store.store import Store
from kvd.wire.checksum import checksum
from kvd.wire.errors import InvalidArgument
from kvd.wire.lookup import UNTOLD_LOOKUPS_MAX
from tests.l2 import MiB, open_devices
from tests.store.support import Recorded, make_store, put, read, run, store_limits

VALUE = b"v" * PAGE_BYTES  # one page each


def _guest_store(pages: int = 4, **limits: int) -> Store:
    store, _ = make_store(pages, **limits)
    store.guest_of = lambda ns, key: key.startswith(b"g")
    return store


def test_guests_stay_out_of_the_policy_and_go_first() -> None:
    store = _guest_store()
    put(store, b"own1", VALUE)
    put(store, b"g1", VALUE)
    put(store, b"own2", VALUE)
    put(store, b"g2", VALUE)
    assert len(store.policy) == 2  # only the owned values
    assert store.stats()["guests"] == 2
    put(store, b"own3", VALUE)  # full: the oldest guest goes
    assert read(store, b"g1") is None
    assert read(store, b"g2") == VALUE
    put(store, b"own4", VALUE)
    assert read(store, b"g2") is None
    assert [read(store, k) for k in (b"own1", b"own2", b"own3", b"own4")] == [VALUE] * 4
    assert store.stats()["guests"] == 0
    put(store, b"own5", VALUE)  # no guest left: the policy picks (lru: the oldest read)
    assert read(store, b"own1") is None


def test_a_value_whose_owner_changed_becomes_a_guest_and_back() -> None:
    store = _guest_store()
    for key in (b"own1", b"own2", b"own3"):
        put(store, key, VALUE)
    entries = store.entries
    moved = entries.get("ns", b"own1")
    assert moved is not None
    entries.set_guest(moved, True)  # another member owns it now
    assert len(store.policy) == 2 and store.stats()["guests"] == 1
    put(store, b"own4", VALUE)
    put(store, b"own5", VALUE)  # full: the guest goes first
    assert read(store, b"own1") is None
    assert [read(store, k) for k in (b"own2", b"own3", b"own4")] == [VALUE] * 3
    put(store, b"g1", VALUE)
    copy = entries.get("ns", b"g1")
    assert copy is not None
    entries.set_guest(copy, False)  # its owner left: this member owns it now
    entries.set_guest(copy, False)  # twice: nothing more
    assert len(store.policy) == 4 and store.stats()["guests"] == 0
    assert read(store, b"g1") == VALUE


def test_a_pinned_guest_is_passed_over() -> None:
    store = _guest_store()
    put(store, b"g1", VALUE)
    put(store, b"g2", VALUE)
    put(store, b"own1", VALUE)
    put(store, b"own2", VALUE)
    pinned = store.peek("ns", b"g1")  # as a forward waiting for its turn pins it
    assert pinned is not None
    try:
        put(store, b"own3", VALUE)
        assert read(store, b"g2") is None  # the older guest was pinned
        put(store, b"own4", VALUE)  # the pinned guest stays; an owned value goes
        assert bytes(b"".join(pinned.views)) == VALUE
        assert sum(read(store, k) is not None for k in (b"own1", b"own2", b"own3", b"own4")) == 3
    finally:
        pinned.close()
    put(store, b"g3", VALUE)  # unpinned now: it goes first again
    assert read(store, b"g1") is None


def test_deleting_a_guest_forgets_it() -> None:
    store = _guest_store()
    put(store, b"g1", VALUE)
    assert run(store.delete("ns", [b"g1"])) == 1
    assert store.stats()["guests"] == 0 and store.entry_count == 0


def test_a_store_outside_a_pool_has_no_guests() -> None:
    store, _ = make_store(4)
    put(store, b"g1", VALUE)
    assert len(store.policy) == 1 and store.stats()["guests"] == 0


async def test_guests_are_not_written_to_l2_unless_durable(tmp_path: Path) -> None:
    devices = open_devices([str(tmp_path / "ssd.dat")], segments=3, segment_bytes=MiB)
    io = open_backend("threads", depth=8)
    tier = L2Tier(devices, io)
    await tier.recover()
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), l2=tier)
    store.guest_of = lambda ns, key: key.startswith(b"g")
    store.start()
    try:
        for key in (b"own", b"g1"):
            await store.put("ns", key, VALUE, checksum=checksum(VALUE), hasher=checksum)
        await store.put("ns", b"g2", VALUE, checksum=checksum(VALUE), hasher=checksum,
                        durable=True)  # fmt: skip
        await store.close(flush_s=10.0)
        assert tier.lookup("ns", b"own") is not None
        assert tier.lookup("ns", b"g1") is None  # its owner keeps it on disk
        assert tier.lookup("ns", b"g2") is not None  # durable: written here too
    finally:
        tier.close()
        io.close()
        devices.close()


def _recording_store() -> tuple[Store, Recorded]:
    recorded = Recorded(make_policy("density"))
    store = Store(Pool(16 * PAGE_BYTES), store_limits(), policy=recorded)
    return store, recorded


def _lookups(recorded: Recorded) -> list[tuple[Any, ...]]:
    return [call for call in recorded.calls if call[0] == "on_lookup"]


def test_learn_chain_teaches_only_the_owned_keys_hits() -> None:
    store, recorded = _recording_store()
    put(store, b"a", VALUE)
    put(store, b"c", VALUE)
    recorded.calls.clear()
    # This member's share of a 5-key chain a ? c d ?: a, c and d.
    store.shares.learn_chain("ns", [b"a", b"c", b"d"], 5, [0, 2, 3])
    store.learning.settle()
    ns_id = store.entries.by_name["ns"].id
    # Hits: a (held), the other member's key, c (held); d is this member's and missing.
    assert recorded.calls == [
        ("touch", (ns_id, b"a")),
        ("touch", (ns_id, b"c")),
        ("on_lookup", tuple((ns_id, k) for k in (b"a", b"", b"c", b"d", b"")), 3),
    ]
    assert recorded.mines == [[True, False, True, True, False]]


@pytest.mark.parametrize(
    ("keys", "length", "positions"),
    [
        ([b"a"], 0, [0]),  # no chain
        ([b"a", b"b"], 5, [0]),  # a position per key
        ([b"a", b"b"], 5, [2, 1]),  # increasing
        ([b"a", b"b"], 5, [1, 1]),
        ([b"a"], 5, [5]),  # within the chain
        ([b"a"], 1 << 30, [0]),  # over max_lookup_keys
    ],
)
def test_a_bad_chain_share_is_refused(keys: list[bytes], length: int, positions: list[int]) -> None:
    store, recorded = _recording_store()
    with pytest.raises(InvalidArgument):
        store.shares.learn_chain("ns", keys, length, positions)
    store.learning.settle()
    assert not _lookups(recorded)


def test_untold_lookups_come_first_and_are_bounded() -> None:
    store, recorded = _recording_store()
    store.shares.learn_chain("ns", [b"a"], 2, [1], untold=2)
    store.learning.settle()
    ns_id = store.entries.by_name["ns"].id
    assert _lookups(recorded) == [
        ("on_lookup", (), 0),
        ("on_lookup", (), 0),
        ("on_lookup", ((ns_id, b""), (ns_id, b"a")), 1),
    ]
    for untold in (-1, UNTOLD_LOOKUPS_MAX + 1):
        with pytest.raises(InvalidArgument, match="untold"):
            store.shares.learn_chain("ns", [b"a"], 2, [1], untold=untold)
    store.learning.settle()
    assert len(_lookups(recorded)) == 3


def test_lookup_passes_mine_to_the_policy() -> None:
    store, recorded = _recording_store()
    put(store, b"a", VALUE)
    store.lookup("ns", [b"a", b"b"], mine=[True, False])
    store.lookup("ns", [b"a", b"b"])
    store.learning.settle()
    assert len(_lookups(recorded)) == 2
    assert recorded.mines == [[True, False], None]


def test_density_with_every_key_mine_is_density() -> None:
    """``mine`` all true changes nothing: the same victims, call for call."""
    plain, masked = make_policy("density"), make_policy("density")
    victims: list[tuple[Any, Any]] = []
    for request in range(400):
        chain = [(request % 7, i) for i in range(request % 5 + 1)]
        for policy, mine in ((plain, None), (masked, [True] * len(chain))):
            policy.on_lookup(chain, 0, mine)
            for i, key in enumerate(chain):
                policy.insert(key, chain[i - 1] if i else None)
        while len(plain) > 12:
            pair = (plain.victim(lambda k: False), masked.victim(lambda k: False))
            victims.append(pair)
            plain.remove(pair[0])
            masked.remove(pair[1])
    assert victims and all(a == b for a, b in victims)


def test_density_keeps_nothing_for_keys_not_mine() -> None:
    """Keys another member owns are not announced: put here later (a guest
    would not be; a key whose owner changed may be) they are unannounced."""
    policy = make_policy("density")
    policy.on_lookup(["x", "y", "z"], 0, [True, False, True])
    assert set(policy._pending) == {"x", "z"}  # type: ignore[attr-defined]


def test_density_links_a_members_blocks_into_a_chain_of_their_own() -> None:
    """A member's blocks of a chain are put with the chain's previous block as
    parent, another member's; the policy links each to the member's block
    before it instead, so its share goes tail first."""
    policy = make_policy("density")
    chain = ["a", "b", "c", "d", "e"]
    policy.on_lookup(chain, 0, [False, True, False, True, False])
    policy.insert("b", "a")
    policy.insert("d", "c")
    # b came first and has the earlier access: as two roots b would go first.
    assert policy.victim(lambda k: False) == "d"
    policy.remove("d")
    assert policy.victim(lambda k: False) == "b"


def test_density_does_not_hold_a_members_last_block_as_being_put() -> None:
    """The rest of a chain goes to other members, so the member's last block
    of it is not a chain still being put: it goes in deadline order, not
    after every other leaf."""
    policy = make_policy("density")
    policy.on_lookup(["a", "b", "c", "d", "e"], 0, [False, True, False, True, False])
    policy.insert("b", "a")
    policy.insert("d", "c")
    policy.on_lookup(["x"], 0, [True])  # a later lookup: a later deadline
    policy.insert("x", None)
    assert policy.victim(lambda k: False) == "d"
