"""Region ops that outlive their client's deadline (a daemon stopped with
SIGSTOP while the ops sit in its socket): once the call has timed out the
caller writes other bytes into the same memory, and the daemon, thawed,
must neither store those bytes under the old key nor copy the old value
over them."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvd.client import Client
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import DeadlineExceeded
from kvd.wire.grpc import KVStoreStub
from tests.support import DaemonFactory, DaemonProcess, wait_until

NS = "late"
SIZE = 256 << 10
TIMEOUT_S = 0.5


def _frozen(daemon: DaemonProcess) -> None:
    os.kill(daemon.proc.pid, signal.SIGSTOP)


def _thawed(daemon: DaemonProcess) -> None:
    os.kill(daemon.proc.pid, signal.SIGCONT)
    with Client(daemon.socket_target, timeout_s=10) as probe:
        probe.stats()  # answered: the daemon has read what was queued before
    time.sleep(0.3)  # and run it


def _fill(byte: int) -> bytes:
    return bytes([byte]) * SIZE


@pytest.mark.parametrize("source", ["buffer", "staging"])
def test_a_put_that_timed_out_never_stores_what_was_written_after_it(
    daemon_factory: DaemonFactory, source: str
) -> None:
    daemon = daemon_factory()
    with Client(daemon.socket_target, timeout_s=TIMEOUT_S) as client:
        client.put(NS, b"warm", _fill(1))
        assert "shm-socket" in client.paths
        room = client.buffer(SIZE)
        _frozen(daemon)
        try:
            if source == "buffer":
                room[:] = _fill(2)
                with pytest.raises(DeadlineExceeded):
                    client.put(NS, b"k", room)
                room[:] = _fill(3)  # the caller's memory is its own again
            else:
                with pytest.raises(DeadlineExceeded):
                    client.put(NS, b"k", _fill(2))
                # The next put takes the same room in staging.
                with pytest.raises(DeadlineExceeded):
                    client.put(NS, b"k-next", _fill(3))
        finally:
            _thawed(daemon)
        client.timeout_s = 10
        # Arrived past its deadline: refused, so a miss (never the 3s).
        assert client.get(NS, b"k") is None
        assert client.get(NS, b"k-next") is None
        client.put(NS, b"after", _fill(4))
        assert client.get(NS, b"after") == _fill(4)
        assert client.get(NS, b"warm") == _fill(1)


def test_a_get_that_timed_out_writes_nothing_later_and_its_region_is_retired(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory("--region-check-ms", "50")
    with Client(daemon.socket_target, timeout_s=TIMEOUT_S) as client:
        client.put(NS, b"k", _fill(5))
        room = client.buffer(SIZE)
        assert client.get_into(NS, b"k", room) == SIZE
        room[:] = _fill(0)
        _frozen(daemon)
        try:
            with pytest.raises(DeadlineExceeded):
                client.get_into(NS, b"k", room)
            with pytest.raises(DeadlineExceeded):
                client.get(NS, b"k")  # into staging
            room[:] = _fill(6)  # the caller's again
        finally:
            _thawed(daemon)
        assert bytes(room) == _fill(6), "the daemon copied into the room after the deadline"
        client.timeout_s = 10
        # Both regions are retired; the client goes on with fresh staging,
        # and the old buffer still works, through staging.
        assert client.get(NS, b"k") == _fill(5)
        assert client.get_into(NS, b"k", room) == SIZE and bytes(room) == _fill(5)
        fresh = client.buffer(SIZE)
        assert client.get_into(NS, b"k", fresh) == SIZE and bytes(fresh) == _fill(5)
        # The daemon freed the retired regions (their lock is gone): the new
        # staging and the fresh buffer are what this client has attached.
        with grpc.insecure_channel(daemon.socket_target) as channel:
            stub = KVStoreStub(channel)

            def attached() -> int:
                return int(stub.DescribePaths(pb.DescribePathsRequest()).regions_attached)

            assert wait_until(lambda: attached() == 2), attached()
