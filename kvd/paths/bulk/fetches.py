"""The GETs of one bulk connection whose value is not in L1, read while the
connection goes on reading frames.

A GET of a value in L1 is answered at once, in order. Any other waits for a
read: its record on L2 into L1 or, in a pool, the value from the key's
owner. Awaited in the reader, such reads went one after the other, so a
client's pipelined GETs of 32 values another member owns paid 32 peer round
trips. Now, when more frames wait in the socket or answers are ahead of it,
the connection's reader starts the read as a task and queues the task where
its answer goes; the writer awaits it when its turn comes. A GET alone is
read and answered by the reader as before (a task and the writer's turn
cost a lone L2 get ~100 µs on a 2-CPU VM). The reads of
a client's pipelined GETs so overlap (in a pool, a batch's reads of one
owner asked in the same turn go together: ``kvd.cluster.nixl_reads``), and
the answers still leave in request order.

Bounded: at most ``FETCHES_MAX`` such GETs per connection are being read or
waiting for the writer; past it the reader waits until the writer takes
one (and TCP slows the client down), so a client that stops reading its
answers pins at most that many values this way (beside the
``bulk_inflight_bytes`` of answers queued from L1). A task's value stays
pinned until the writer sent it, or until the connection ends (``close``: a
task not sent is cancelled, or its value unpinned).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvd.store.index import Reader
from kvd.wire.bulk import CODE_NOT_FOUND, CODE_RESOURCE_EXHAUSTED, OP_GET, Request, encode_response

# GETs of one connection being read, or read and waiting for the writer.
FETCHES_MAX = 8

# A GET's answer: its header, and the pinned value it sends (None for a code alone).
Answer = tuple[bytes, Reader | None]


class Fetches:
    """The reads one connection's GETs have in flight, and their answers not yet sent."""

    def __init__(self) -> None:
        self._room = asyncio.Semaphore(FETCHES_MAX)
        self._unsent: set[asyncio.Task[Answer]] = set()

    async def start(self, read: Coroutine[Any, Any, Answer]) -> asyncio.Task[Answer]:
        """``read`` as a task, once fewer than FETCHES_MAX run."""
        try:
            await self._room.acquire()
        except BaseException:
            read.close()
            raise
        task = asyncio.get_running_loop().create_task(read)
        self._unsent.add(task)
        return task

    async def answer(self, task: asyncio.Task[Answer]) -> Answer:
        """The answer of ``task``, once it is read; from here the caller sends
        it (and closes its reader), and the reader may start another."""
        answer = await task
        self._unsent.discard(task)  # no await since: nothing can be lost in between
        self._room.release()
        return answer

    def close(self) -> None:
        """The connection ended: reads still running are cancelled, values read
        and not sent are unpinned."""
        for task in self._unsent:
            if task.done():
                _unpin(task)
            else:
                task.cancel()
                task.add_done_callback(_unpin)
        self._unsent.clear()


def get_answer(request: Request, reader: Reader | None) -> Answer:
    """A GET's header, and the value it sends (None: a miss, counted, or a
    value over the room the request names, unpinned here)."""
    rid = request.request_id
    if reader is None:
        return encode_response(OP_GET, rid, CODE_NOT_FOUND), None
    if request.length and reader.size > request.length:
        reader.close()
        message = f"value of {reader.size} bytes, room for {request.length}"
        code = CODE_RESOURCE_EXHAUSTED
        return encode_response(OP_GET, rid, code, message=message, length=reader.size), None
    header = encode_response(
        OP_GET, rid, meta=reader.meta, length=reader.size, checksum=reader.checksum
    )
    return header, reader


def _unpin(task: asyncio.Task[Answer]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    _, reader = task.result()
    if reader is not None:
        reader.close()
