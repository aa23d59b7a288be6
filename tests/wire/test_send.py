"""kvd.wire.send in-process, with offload on whatever this machine has: two
answers at once (the second from a send thread) arrive whole and in order; a
client that reads nothing times both out; a cancelled send shuts its socket
down and returns once its thread let go of the payload."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvd.wire.send import Sender

PAYLOAD_BYTES = 8 << 20  # far more than a Unix socket buffers


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(2)]
    for ours, _ in made:
        ours.setblocking(False)
    yield made
    for ours, theirs in made:
        ours.close()
        theirs.close()


def _parts(payload: bytes) -> list[memoryview]:
    view = memoryview(payload)
    return [view[:100], view[100 : 3 << 20], view[3 << 20 :]]  # a header, then pages


async def _send_both(
    sender: Sender, pairs: list[tuple[socket.socket, socket.socket]], payloads: list[bytes]
) -> list[BaseException | None]:
    """Both payloads at once, each on its pair's socket: the first on the event
    loop, the second (another send being under way) on a send thread."""
    return await asyncio.gather(
        *(
            sender.send(ours, _parts(payload), PAYLOAD_BYTES)
            for (ours, _), payload in zip(pairs, payloads, strict=True)
        ),
        return_exceptions=True,
    )


def _read_all(sock: socket.socket, nbytes: int, into: list[bytes]) -> None:
    chunks, got = [], 0
    while got < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
        time.sleep(0.001)  # a slow reader: the sender waits for room many times
    into.append(b"".join(chunks))


def test_two_answers_at_once_arrive_whole(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    payloads = [os.urandom(PAYLOAD_BYTES), os.urandom(PAYLOAD_BYTES)]
    received: list[list[bytes]] = [[], []]
    readers = [
        threading.Thread(target=_read_all, args=(theirs, PAYLOAD_BYTES, received[i]))
        for i, (_, theirs) in enumerate(pairs)
    ]
    for reader in readers:
        reader.start()
    sender = Sender(timeout_s=10, offload=True)
    results = asyncio.run(_send_both(sender, pairs, payloads))
    assert results == [None, None]
    for reader in readers:
        reader.join(10)
    assert [got[0] for got in received] == payloads
    assert sender.sending == 0
    sender.close()


def test_a_client_that_reads_nothing_times_out(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    sender = Sender(timeout_s=0.3, offload=True)
    start = time.monotonic()
    results = asyncio.run(_send_both(sender, pairs, [bytes(PAYLOAD_BYTES)] * 2))
    assert all(isinstance(r, TimeoutError) for r in results), results
    assert all("did not read its answer" in str(r) for r in results)
    assert time.monotonic() - start < 3
    sender.close()


def test_a_cancelled_send_lets_go_of_the_payload_at_once(
    pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    sender = Sender(timeout_s=30, offload=True)
    payload = bytes(PAYLOAD_BYTES)

    async def cancel_both() -> float:
        tasks = [
            asyncio.create_task(sender.send(ours, _parts(payload), PAYLOAD_BYTES))
            for ours, _ in pairs
        ]
        await asyncio.sleep(0.2)  # both stuck: one on the loop, one on a thread
        start = time.monotonic()
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        return time.monotonic() - start

    assert asyncio.run(cancel_both()) < 2  # not the 30 s timeout
    assert sender.sending == 0
    sender.close()
