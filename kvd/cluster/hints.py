"""What the pool's owners last said of keys, kept for a while, so that a
lookup of a chain asked about moments ago is answered without asking again.

An engine asks about the same chain again and again: kvd's vLLM connector
looks a waiting request's prompt up at every scheduler step until the
request runs, and requests that share a system prompt look its blocks up
one after the other. Over a pool each such lookup waited for a round trip
to every owner of the chain's keys past the local prefix. ``Hints`` keeps
each key's last answer (held or not) from its owner; a lookup whose keys
past the local prefix all have one is answered from them, and the owners
are told of it in the background (their eviction policies learn as
before: ``kvd.cluster.router``).

A hint is used for ``ttl_s`` (``pool_lookup_hint_ms``) at least and twice
that at most: answers go into the current generation; when it is ``ttl_s``
old (or holds ``HINTS_MAX`` keys) it becomes the previous one, which is
dropped once it began twice ``ttl_s`` ago. Expiry costs nothing per key,
and the memory is bounded.

A key is hinted held only where its owner said it keeps the key for as
long as the hint may be used (``kvd.cluster.promises``: an owner with the
same setting pins it in L1); a key held but not so kept gets no hint "held"
and its owner is asked again. What a hint can cost, never a wrong block
nor an error:

* a key its owner lost anyway (deleted, or a member whose setting is
  shorter or off: it keeps nothing) is claimed held: the engine's get of it
  misses, and the engine recomputes the block (kvd's vLLM connector
  reports it in ``get_block_ids_with_load_errors``);
* a key stored since its owner answered "not held" is a miss it need not
  have been.

The router drops a key's hint when a get finds its owner without it or a
put of it lands here, uses no hint of a member it marked down, and drops
every hint when the placement changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvd.wire.bulk import EXISTS_KEPT, EXISTS_NOT_HELD

# Keys in one generation; past it the generation turns early. At most twice
# this many are kept (~25 MB at 1 << 17 keys of 32 bytes).
HINTS_MAX = 1 << 17


class Hints:
    """Owners' last answers per (namespace, key), in two generations."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._current: dict[str, dict[bytes, bool]] = {}
        self._previous: dict[str, dict[bytes, bool]] = {}
        self._count = 0  # keys noted into the current generation
        self._began = self._previous_began = time.monotonic()  # each generation's first moment

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def note(self, namespace: str, keys: Sequence[bytes], held: Sequence[bool]) -> None:
        """The owner's answer for ``keys``, as of now."""
        if not self.enabled:
            return
        self._age()
        self._current.setdefault(namespace, {}).update(zip(keys, held, strict=True))
        self._count += len(keys)
        if self._count >= HINTS_MAX:
            self._turn()

    def note_answers(self, namespace: str, keys: Sequence[bytes], answers: bytes) -> None:
        """An owner's PEER_EXISTS answer for ``keys``: a key it keeps for
        hints (``EXISTS_KEPT``) is noted held, one it does not hold not
        held; one it holds but does not keep (``EXISTS_HELD``, or a byte of
        a later kind) gets no new hint (its owner is asked again)."""
        if not self.enabled:
            return
        if answers.count(EXISTS_NOT_HELD) + answers.count(EXISTS_KEPT) == len(answers):
            self.note(namespace, keys, list(map(bool, answers)))
            return
        kinds = (EXISTS_NOT_HELD, EXISTS_KEPT)
        noted = [(k, a) for k, a in zip(keys, answers, strict=True) if a in kinds]
        if noted:
            self.note(namespace, [k for k, _ in noted], [a == EXISTS_KEPT for _, a in noted])

    def of(self, namespace: str, keys: Sequence[bytes]) -> list[bool | None]:
        """Each key's hint: held, not held, or None (none, or too old)."""
        self._age()
        current, previous = self._current.get(namespace), self._previous.get(namespace)
        if current is None:
            # Answers repeated from the previous generation are not noted again
            # (told owners do not answer): a chain's come from there alone.
            return list(map(previous.get, keys)) if previous is not None else [None] * len(keys)
        hints: list[bool | None] = list(map(current.get, keys))
        if previous is not None and None in hints:
            hints = [previous.get(key) if hint is None else hint
                     for key, hint in zip(keys, hints, strict=True)]  # fmt: skip
        return hints

    def settle(self, namespace: str, keys: Sequence[bytes], here: Sequence[bool]) -> int | None:
        """How many of ``keys`` (a chain's, past its local prefix, each
        held here or owned by another member: ``here``) run on held by the
        owners' answers; None when a key before the first one not held has
        no answer (then its owner must be asked)."""
        hints = self.of(namespace, keys)
        merged = [True if held else hint for held, hint in zip(here, hints, strict=False)]
        cut = merged.index(False) if False in merged else len(merged)
        return None if None in merged[:cut] else cut

    def forget(self, namespace: str, key: bytes) -> None:
        for generation in (self._current, self._previous):
            keys = generation.get(namespace)
            if keys is not None:
                keys.pop(key, None)

    def clear(self) -> None:
        self._current, self._previous, self._count = {}, {}, 0
        self._began = self._previous_began = time.monotonic()

    def __len__(self) -> int:
        return sum(map(len, self._current.values())) + sum(map(len, self._previous.values()))

    def _age(self) -> None:
        """Turn the generations as they come of age; a hint is used until it
        is twice ``ttl_s`` old at most (its generation began before it)."""
        now = time.monotonic()
        if now - self._began >= self.ttl_s:
            self._turn(now)
        if now - self._previous_began >= 2 * self.ttl_s:
            self._previous = {}

    def _turn(self, now: float | None = None) -> None:
        self._previous, self._previous_began = self._current, self._began
        self._current, self._count = {}, 0
        self._began = time.monotonic() if now is None else now
