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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Chains remembered.
LAYOUTS_MAX = 64


@dataclass(frozen=True, slots=True)
class Layout:
    owners: list[str]  # each key's owner
    mine: list[bool]  # whether it is this member's
    shares: dict[str, list[int]]  # each other owner's positions, owners in the chain's order


class Layouts:
    """The layouts of the chains looked up last, for one placement."""

    def __init__(self, owners_of: Callable[[str, list[bytes]], list[str]]) -> None:
        """``owners_of(namespace, keys)``: each key's owner (kvd.cluster.router)."""
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
