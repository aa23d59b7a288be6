"""Fault injection for the L2 tier's block I/O (tests only).

``wrap(backend, spec)`` returns an IoBackend that passes ops to ``backend``
except where a rule of ``spec`` fires; the daemon wraps its backend this way
when the ``io_faults`` setting is not empty, so a test can break a real
daemon's disk in a chosen, repeatable way. Nothing here is random: the same
spec and the same sequence of ops give the same faults.

The spec's grammar (``op:fault:param``, e.g.
``write:eio:nth=5,read:short:every=3``) and its parser live in
``kvd.config.io_faults``: the setting's check uses them without loading a
backend.

Every rule counts the ops of its kind on its own (an op is one entry of a
``submit_many`` batch, or one read/write/fsync call); when several rules
fire on the same op, the first one in the spec applies. ``after_bytes``
counts only bytes of ops that went through unharmed.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence

from kvd.config.io_faults import BLOCK_BYTES, Rule, parse
from kvd.io.backend import IoBackend, IoError, IoOp, OpKind

# The ops of each kind a rule names.
_KINDS = {
    "read": (OpKind.READ,),
    "write": (OpKind.WRITE,),
    "fsync": (OpKind.FSYNC, OpKind.FDATASYNC),
}


def _matches(rule: Rule, kind: OpKind) -> bool:
    return kind in _KINDS[rule.op]


def _nbytes(op: IoOp) -> int:
    return sum(len(b) for b in op.bufs)


def _shorten(op: IoOp) -> IoOp | None:
    """The op cut to the first half of its bytes (whole 4 KiB blocks), or None."""
    keep = _nbytes(op) // 2 // BLOCK_BYTES * BLOCK_BYTES
    bufs: list[memoryview] = []
    for buf in op.bufs:
        if keep <= 0:
            break
        bufs.append(buf[:keep])
        keep -= len(bufs[-1])
    return IoOp(op.kind, op.fd, op.offset, bufs) if bufs else None


class FaultyBackend:
    """An IoBackend that breaks the ops its rules pick and passes on the rest."""

    def __init__(self, inner: IoBackend, rules: Sequence[Rule]) -> None:
        self.inner = inner
        self.rules = list(rules)
        self.name = f"{inner.name}+faults"
        self.injected: list[tuple[str, IoOp]] = []  # (rule, op), newest last

    def _pick(self, op: IoOp) -> Rule | None:
        nbytes = _nbytes(op)
        chosen: Rule | None = None
        for rule in self.rules:
            if _matches(rule, op.kind) and rule.fires(nbytes) and chosen is None:
                chosen = rule
        if chosen is None:
            for rule in self.rules:
                if _matches(rule, op.kind):
                    rule.moved_bytes += nbytes
        else:
            chosen.fired += 1
            self.injected.append((str(chosen), op))
        return chosen

    async def submit_many(self, ops: Sequence[IoOp]) -> list[int]:
        results: list[int] = [0] * len(ops)
        passed: list[tuple[int, IoOp, bool]] = []  # (index, op to run, misdirected)
        for i, op in enumerate(ops):
            rule = self._pick(op)
            if rule is None:
                passed.append((i, op, False))
            elif rule.fault in ("eio", "enospc"):
                results[i] = -(errno.EIO if rule.fault == "eio" else errno.ENOSPC)
            elif rule.fault == "short":
                shortened = _shorten(op)
                if shortened is not None:
                    passed.append((i, shortened, False))
            else:
                moved = IoOp(op.kind, op.fd, op.offset + rule.shift_bytes, op.bufs)
                passed.append((i, moved, True))
        if passed:
            done = await self.inner.submit_many([op for _, op, _ in passed])
            for (i, _, misdirected), result in zip(passed, done, strict=True):
                # A misdirected op claims it did all of its work.
                results[i] = _nbytes(ops[i]) if misdirected and result >= 0 else result
        return results

    async def _one(self, op: IoOp) -> int:
        (result,) = await self.submit_many([op])
        if result < 0:
            raise IoError(-result, f"{op.kind.name.lower()} fd={op.fd} offset={op.offset}")
        return result

    async def read(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self._one(IoOp(OpKind.READ, fd, offset, bufs))

    async def write(self, fd: int, offset: int, bufs: Sequence[memoryview]) -> int:
        return await self._one(IoOp(OpKind.WRITE, fd, offset, bufs))

    async def fsync(self, fd: int, *, data_only: bool = False) -> None:
        kind = OpKind.FDATASYNC if data_only else OpKind.FSYNC
        rule = self._pick(IoOp(kind, fd))
        if rule is not None:
            code = errno.EIO if rule.fault == "eio" else errno.ENOSPC
            raise IoError(code, f"fsync fd={fd} (injected: {rule})")
        await self.inner.fsync(fd, data_only=data_only)

    def close(self) -> None:
        self.inner.close()


def wrap(backend: IoBackend, spec: str) -> IoBackend:
    """``backend`` with the faults of ``spec``; ``backend`` itself when spec is empty."""
    rules = parse(spec)
    if not rules:
        return backend
    return FaultyBackend(backend, rules)


def describe(backend: IoBackend) -> str:
    """One line for logs: which faults a backend injects (empty when none)."""
    if isinstance(backend, FaultyBackend):
        return ",".join(str(rule) for rule in backend.rules)
    return ""
