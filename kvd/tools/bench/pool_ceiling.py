"""The TCP ceiling between two nodes: a plain sender and receiver, each its
own process (inside its node's namespace when there is a lab), moving
``count`` values of ``value_bytes`` with large ``sendall`` / ``recv_into``
over one connection, the way a peer read moves a value.

``python -m kvd.tools.bench.pool_ceiling recv HOST PORT VALUE_BYTES COUNT``
prints ``ready PORT`` once listening, then one JSON line (seconds from
accept to the last byte, bytes); ``... send HOST PORT VALUE_BYTES COUNT``
connects and sends.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

# A stuck run (a peer that never connects) ends here instead of hanging.
RUN_TIMEOUT_S = 120.0
CONNECT_TRIES = 50


def receive(host: str, port: int, value_bytes: int, count: int) -> None:
    with socket.create_server((host, port)) as server:
        print(f"ready {server.getsockname()[1]}", flush=True)
        server.settimeout(RUN_TIMEOUT_S)
        conn, _ = server.accept()
        with conn:
            buffer = memoryview(bytearray(value_bytes))
            started = time.perf_counter()
            total = 0
            for _ in range(count):
                got = 0
                while got < value_bytes:
                    n = conn.recv_into(buffer[got:])
                    if n == 0:
                        raise ConnectionError(f"sender closed after {total + got} bytes")
                    got += n
                total += got
            seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "bytes": total}), flush=True)


def send(host: str, port: int, value_bytes: int, count: int) -> None:
    payload = bytes(range(256)) * (value_bytes // 256) + bytes(value_bytes % 256)
    for attempt in range(CONNECT_TRIES):
        try:
            conn = socket.create_connection((host, port), timeout=RUN_TIMEOUT_S)
            break
        except OSError:
            if attempt == CONNECT_TRIES - 1:
                raise
            time.sleep(0.05)
    with conn:
        for _ in range(count):
            conn.sendall(payload)


def measure(
    receiver_host: str,
    port: int,
    value_bytes: int,
    count: int,
    on_receiver: Callable[[list[str]], list[str]],
    on_sender: Callable[[list[str]], list[str]],
) -> dict[str, float]:
    """One run: the receiver started with ``on_receiver(argv)`` (e.g. inside
    node A), the sender with ``on_sender(argv)``; bytes/s as the receiver saw it."""
    base = [sys.executable, "-m", "kvd.tools.bench.pool_ceiling"]
    sizes = [str(value_bytes), str(count)]
    receiver = subprocess.Popen(
        on_receiver([*base, "recv", receiver_host, str(port), *sizes]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        ready = receiver.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "ready":
            raise RuntimeError(f"ceiling receiver did not start: {ready}")
        subprocess.run(
            on_sender([*base, "send", receiver_host, ready[1], *sizes]),
            check=True,
            timeout=RUN_TIMEOUT_S,
        )
        result = json.loads(receiver.stdout.readline())
        receiver.wait(RUN_TIMEOUT_S)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        if receiver.stdout is not None:
            receiver.stdout.close()
    seconds = float(result["seconds"])
    return {"bytes": float(result["bytes"]), "seconds": seconds,
            "bytes_per_s": result["bytes"] / seconds}  # fmt: skip


def main(argv: Sequence[str]) -> int:
    role, host, port, value_bytes, count = argv
    work = receive if role == "recv" else send
    work(host, int(port), int(value_bytes), int(count))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
