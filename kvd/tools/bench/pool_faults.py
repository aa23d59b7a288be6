"""``kvd bench pool``'s faults: an owner's link cut, the owner stopped
(SIGSTOP), the owner killed (SIGKILL), each while an engine on another node
reads a chain through its own daemon. What the engine saw is counted: every
call's time against its deadline, wrong bytes, errors, misses.

Three members; each value is stored by its owner, so the engine's node holds
only its own share and the owner's keys must come from the owner. The
engine calls over shared memory and over gRPC on its daemon's Unix socket,
each call with ``DEADLINE_S``; peer calls give up after ``PEER_TIMEOUT_MS``.
A cut needs a lab (namespaces): on loopback that row is left out.
"""

from __future__ import annotations

import hashlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvd.client import Client, KvdError
from kvd.tools.bench.pool_nodes import Pool

DEADLINE_S = 0.5
PEER_TIMEOUT_MS = 200  # the daemon's default
MARGIN_S = 0.010  # the contract: p99 within the deadline + 10 ms
KEYS = 60
ROUNDS = 3  # gets of every key per client and fault
# A peer that failed is skipped for 1 s, and a channel reconnects within
# 2 s of backoff: a member healed serves again well within this.
BACK_S = 15.0


def value_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest() * 512  # 16 KiB, different per key


@dataclass
class Ledger:
    seconds: list[float] = field(default_factory=list)
    wrong_bytes: int = 0
    errors: int = 0
    misses: int = 0

    def call(self, work: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return work()
        except KvdError:
            self.errors += 1
            return None
        finally:
            self.seconds.append(time.perf_counter() - started)

    def get(self, client: Client, ns: str, key: bytes) -> None:
        value = self.call(lambda: client.get(ns, key))
        if value is None:
            self.misses += 1
        elif value != value_of(key):
            self.wrong_bytes += len(value)

    def figures(self) -> dict[str, Any]:
        p50, p99 = np.percentile(self.seconds, [50, 99]) * 1e3
        return {
            "calls": len(self.seconds),
            "p50_ms": float(p50),
            "p99_ms": float(p99),
            "max_ms": max(self.seconds) * 1e3,
            "wrong_bytes": self.wrong_bytes,
            "errors": self.errors,
            "misses": self.misses,
        }


def _store_through_owners(pool: Pool, ns: str) -> list[bytes]:
    keys = [f"{ns}-{i:03d}".encode() for i in range(KEYS)]
    for i, member in enumerate(pool.members):
        with Client(member.socket_target, token=pool.token, timeout_s=10) as client:
            for key in pool.owned_by(i, ns, keys):
                client.put(ns, key, value_of(key))
    return keys


def _engine_calls(pool: Pool, ledger: Ledger, ns: str, keys: list[bytes]) -> None:
    target = pool.members[0].socket_target
    for shm in (None, False):  # shared memory (the default), then gRPC
        with Client(target, token=pool.token, timeout_s=DEADLINE_S, shm=shm) as client:
            for _ in range(ROUNDS):
                ledger.call(partial(client.lookup, ns, keys))
                for key in keys:
                    ledger.get(client, ns, key)


def _serves_again(pool: Pool, ns: str, key: bytes) -> float:
    """Seconds until the engine's daemon reads ``key`` from its owner again."""
    started = time.monotonic()
    with Client(pool.members[0].socket_target, token=pool.token, timeout_s=DEADLINE_S) as c:
        while time.monotonic() - started < BACK_S:
            try:
                if c.get(ns, key) == value_of(key):
                    return time.monotonic() - started
            except KvdError:
                pass
            time.sleep(0.05)
    return float("inf")


def run(root: Path, netns: bool, progress: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    with Pool(root / "faults", 3, netns=netns, peer_timeout_ms=PEER_TIMEOUT_MS,
              dram="64MiB", max_value="1MiB", ssd="") as pool:  # fmt: skip
        owner = pool.members[2]
        lab = pool.lab
        faults: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
            ("SIGSTOP", lambda: owner.signal(signal.SIGSTOP), lambda: owner.signal(signal.SIGCONT)),
            ("SIGKILL, restarted", owner.kill, owner.restart),
        ]  # fmt: skip
        if lab is not None:
            faults.insert(0, ("link cut", lambda: lab.link_down(2), lambda: lab.link_up(2)))
        for name, inject, heal in faults:
            progress(f"pool: fault, {name}")
            ns = "fault-" + name.split()[0].split(",")[0].lower()
            keys = _store_through_owners(pool, ns)
            on_owner = pool.owned_by(2, ns, keys)
            ledger = Ledger()
            inject()
            try:
                _engine_calls(pool, ledger, ns, keys)
            finally:
                heal()
            back_s = _serves_again(pool, ns, on_owner[0]) if "KILL" not in name else None
            rows.append({
                "fault": name, "keys": len(keys), "keys_on_the_owner": len(on_owner),
                "deadline_ms": DEADLINE_S * 1e3, "peer_timeout_ms": PEER_TIMEOUT_MS,
                "serves_again_s": back_s, **ledger.figures(),
            })  # fmt: skip
    return {"where": pool.where, "rows": rows}
