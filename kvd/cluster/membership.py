"""The pool's current member list, as its source (static list, etcd) last
gave it, and the checks a list passes before it is used.

A list is refused, with one error line, when it does not name this daemon
(``pool_advertise``): placing keys on a pool this daemon is not part of would
send its own puts away. A member named twice counts once (a warning). A
refused list leaves the previous membership in place; at start that is this
daemon alone, so the daemon keeps serving what it holds. The source reports
whether it is reachable (``stale``): etcd going away keeps the last list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvd.cluster.rendezvous import Placement
from kvd.config.pool_members import normalize

log = logging.getLogger("kvd.cluster")


class Membership:
    """The members and their placement; ``update`` replaces both at once."""

    def __init__(self, advertise: str) -> None:
        self.advertise = normalize(advertise)
        self.placement = Placement([self.advertise])
        self.stale = False  # the source is unreachable: this is its last list
        self.changes = 0
        self.refused = 0
        self._on_change: list[Callable[[tuple[str, ...]], None]] = []
        self._last_refused: tuple[str, ...] | None = None

    @property
    def members(self) -> tuple[str, ...]:
        return self.placement.members

    def on_change(self, callback: Callable[[tuple[str, ...]], None]) -> None:
        """Call ``callback(members)`` after each accepted change."""
        self._on_change.append(callback)

    def update(self, members: Iterable[str], source: str) -> bool:
        """Use ``members`` if it passes the checks; False when refused or unchanged."""
        seen: list[str] = []
        twice: list[str] = []
        for member in members:
            (twice if member in seen else seen).append(member)
        if twice:
            log.warning(
                "pool member list names a member more than once; counted once",
                extra={"source": source, "members": ",".join(sorted(set(twice)))},
            )
        if self.advertise not in seen:
            self.refused += 1
            listed = tuple(sorted(seen))
            if listed != self._last_refused:  # one line per distinct bad list
                self._last_refused = listed
                log.error(
                    "pool member list does not name this daemon (pool_advertise); "
                    "ignored, keeping the previous members",
                    extra={
                        "source": source,
                        "advertise": self.advertise,
                        "listed": ",".join(listed),
                        "members": ",".join(self.members),
                    },
                )
            return False
        self._last_refused = None
        placement = Placement(seen)
        if placement.members == self.members:
            return False
        self.placement = placement
        self.changes += 1
        log.info(
            "pool members changed",
            extra={"source": source, "count": len(seen), "members": ",".join(placement.members)},
        )
        for callback in self._on_change:
            callback(placement.members)
        return True

    def set_stale(self, stale: bool, source: str, error: str = "") -> None:
        """The source became unreachable (keep the last list) or reachable again."""
        if stale == self.stale:
            return
        self.stale = stale
        if stale:
            log.warning(
                "pool membership source unreachable; keeping the last members",
                extra={"source": source, "error": error, "members": ",".join(self.members)},
            )
        else:
            log.info("pool membership source reachable again", extra={"source": source})


def parse_member(value: bytes) -> str | None:
    """A member address read from a membership source, or None for garbage."""
    try:
        return normalize(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
