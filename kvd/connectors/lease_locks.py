"""Keys an engine locked, mapped onto the daemon leases that pin them.

Engines lock and unlock keys one by one (LMCache's MP-mode L2 adapters do);
a kvd lease pins a whole Lookup's hits at once. ``LockTable`` records which
lease holds each locked key and says when a lease's last key is unlocked, so
the connector can release it. No daemon calls here: the connector makes them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Keys locked at once, each a pin in a daemon lease. A 128K-token prompt in
# 256-token chunks is 512 keys per row: this holds a few hundred such lookups.
LOCKED_KEYS_MAX = 1 << 17


@dataclass(eq=False, slots=True)
class _Hold:
    """One daemon lease and how many of its keys are still locked."""

    serial: int
    ns: str
    lease_id: int
    keys: list[Any]
    expires_s: float
    locked: int


class LockTable:
    """Which daemon lease holds each locked key; thread-safe and bounded.

    LMCache unlocks keys, not lookups: a lease is released when the last of
    its keys is unlocked. A key locked by two lookups holds two leases and is
    unlocked twice, the oldest lease first. Holds past their lease's expiry
    are dropped when room is needed (the daemon ended them already).
    """

    def __init__(self, keys_max: int = LOCKED_KEYS_MAX) -> None:
        self.keys_max = keys_max
        self._holds: collections.OrderedDict[int, _Hold] = collections.OrderedDict()
        self._by_key: dict[Any, collections.deque[_Hold]] = {}
        self._count = 0
        self._serial = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def add(self, ns: str, lease_id: int, keys: list[Any], expires_s: float) -> bool:
        """Record a lease over ``keys``; False when the table is full."""
        with self._lock:
            self._drop_expired(time.monotonic())
            if self._count + len(keys) > self.keys_max:
                return False
            self._serial += 1
            hold = _Hold(self._serial, ns, lease_id, keys, expires_s, len(keys))
            self._holds[hold.serial] = hold
            for key in keys:
                self._by_key.setdefault(key, collections.deque()).append(hold)
            self._count += len(keys)
            return True

    def remove(self, keys: Sequence[Any]) -> list[tuple[str, int]]:
        """Unlock ``keys`` (unknown ones are ignored); the leases now free to release."""
        done: list[tuple[str, int]] = []
        with self._lock:
            for key in keys:
                holds = self._by_key.get(key)
                if not holds:
                    continue
                hold = holds.popleft()
                if not holds:
                    del self._by_key[key]
                hold.locked -= 1
                self._count -= 1
                if hold.locked == 0:
                    del self._holds[hold.serial]
                    done.append((hold.ns, hold.lease_id))
        return done

    def drain(self) -> list[tuple[str, int]]:
        """Forget every hold; the leases they held."""
        with self._lock:
            leases = [(hold.ns, hold.lease_id) for hold in self._holds.values()]
            self._holds.clear()
            self._by_key.clear()
            self._count = 0
        return leases

    def _drop_expired(self, now: float) -> None:
        while self._holds:
            hold = next(iter(self._holds.values()))
            if hold.expires_s > now:
                return
            del self._holds[hold.serial]
            for key in hold.keys:
                holds = self._by_key.get(key)
                if holds is None:
                    continue
                with contextlib.suppress(ValueError):  # this key was unlocked already
                    holds.remove(hold)
                if not holds:
                    del self._by_key[key]
            self._count -= hold.locked
