"""Where a chain's keys lie in the pool, remembered per chain: each key's
owner, which are this member's, and each other owner's positions (its share,
in the chain's order).

An engine looks the same chains up again and again (vLLM asks about a
waiting request at every scheduler step), and laying a 1,000-key chain out
took the asking member ~0.15 ms of Python per lookup on the development VM
(a dict lookup per key for its owner, then a loop over the keys for the
shares), a fifth of its CPU per pooled lookup. A chain met again costs one
join of its keys and one dict lookup. Chains are told apart by their
namespace and keys (all of one width, concatenated: the key's bytes); a
chain of keys of mixed widths is laid out each time.

At most ``LAYOUTS_MAX`` chains are kept (~50 KB each at 1,000 keys of 32
bytes), the least recently used dropped first, and all are dropped when the
placement changes. A layout's lists are shared by the lookups that use it:
read them, never change them.

Each key's owner is remembered too (``Owners``), for chains and single keys
alike: placing a 1,000-key chain over four members costs ~0.35 ms, and a
chain whose owners are all remembered one C loop over a dict (~25 µs,
against ~90 µs for a call per key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Chains remembered.
LAYOUTS_MAX = 64
# Owners remembered (kvd.cluster.rendezvous is ~0.35 us a key and member);
# all are forgotten when the placement changes or past this many (~10 MB).
OWNERS_CACHED_MAX = 65_536


class Placing(Protocol):
    def owner(self, namespace: str, key: bytes) -> str: ...


class Owners:
    """Each key's owner under the current placement (``placement()``), remembered."""

    def __init__(self, placement: Callable[[], Placing]) -> None:
        self._placement = placement
        self._owners: dict[str, dict[bytes, str]] = {}  # by namespace, then key
        self._count = 0
        self._of: object = None  # the placement _owners is of

    def of(self, namespace: str, key: bytes) -> str:
        known = self._known(namespace)
        owner = known.get(key)
        if owner is None:
            owner = known[key] = self._placement().owner(namespace, key)
            self._count += 1
        return owner

    def of_chain(self, namespace: str, keys: list[bytes]) -> list[str]:
        """Each key's owner: an engine looks the same chains up again and
        again (vLLM once per waiting request and step)."""
        known = self._known(namespace)
        owners = list(map(known.get, keys))
        if None in owners:
            placement = self._placement()
            for i, owner in enumerate(owners):
                if owner is None:
                    owners[i] = known[keys[i]] = placement.owner(namespace, keys[i])
                    self._count += 1
        return owners  # type: ignore[return-value]  # every None was filled

    def _known(self, namespace: str) -> dict[bytes, str]:
        """The owners remembered in ``namespace``, for the current placement
        (all are forgotten when it changes, or past OWNERS_CACHED_MAX)."""
        placement = self._placement()
        if placement is not self._of or self._count >= OWNERS_CACHED_MAX:
            self._of, self._owners, self._count = placement, {}, 0
        return self._owners.setdefault(namespace, {})


@dataclass(frozen=True, slots=True)
class Layout:
    owners: list[str]  # each key's owner
    mine: list[bool]  # whether it is this member's
    shares: dict[str, list[int]]  # each other owner's positions, owners in the chain's order


class Layouts:
    """The layouts of the chains looked up last, for one placement."""

    def __init__(self, owners_of: Callable[[str, list[bytes]], list[str]]) -> None:
        """``owners_of(namespace, keys)``: each key's owner (``Owners.of_chain``)."""
        self._owners_of = owners_of
        self._layouts: dict[tuple[str, int, bytes], Layout] = {}
        self._placement: object = None

    def of(self, namespace: str, keys: list[bytes], me: str, placement: object) -> Layout:
        """The chain's layout under ``placement``, ``me`` this member."""
        if placement is not self._placement:
            self._layouts, self._placement = {}, placement
        joined = b"".join(keys)
        name = (namespace, len(keys), joined)
        widths = set(map(len, keys))
        layout = self._layouts.pop(name, None) if len(widths) == 1 else None
        if layout is None:
            layout = self._lay_out(namespace, keys, me)
        if len(widths) == 1:
            self._layouts[name] = layout  # the most recent last
            if len(self._layouts) > LAYOUTS_MAX:
                del self._layouts[next(iter(self._layouts))]
        return layout

    def __len__(self) -> int:
        return len(self._layouts)

    def _lay_out(self, namespace: str, keys: list[bytes], me: str) -> Layout:
        owners = self._owners_of(namespace, keys)
        shares: dict[str, list[int]] = {owner: [] for owner in dict.fromkeys(owners)}
        for position, owner in enumerate(owners):
            shares[owner].append(position)
        shares.pop(me, None)
        return Layout(owners, [owner == me for owner in owners], shares)
