"""TLS to etcd (``pool_etcd_ca_file``, and a client certificate with
``pool_etcd_cert_file`` and ``pool_etcd_key_file`` for an etcd started with
``--client-cert-auth``).

aetcd 1.0 opens plaintext channels only (its ``Client.connect`` calls
``grpc.aio.insecure_channel``, and it takes no credentials), so
``TlsClient`` repeats that connect with a TLS channel; everything else is
aetcd's. The files are read at start (a file that does not parse stops
the daemon there) and again for each new session with etcd
(``EtcdCredentials``): a certificate rotated on disk (cert-manager, say)
is used from the next session on, and the session that an expired one
loses is followed by one with the new files. A read that fails then keeps
the last good files, and says why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from kvd.cluster.client_tls import ClientTls
from kvd.config.settings import Config, ConfigError

log = logging.getLogger("kvd.cluster")


def etcd_tls(config: Config) -> ClientTls | None:
    """The files ``config`` names, checked; None without ``pool_etcd_ca_file``."""
    if not config.pool_etcd_ca_file:
        return None
    return ClientTls.read(
        (config.pool_etcd_ca_file, "pool_etcd_ca_file"),
        (config.pool_etcd_cert_file, "pool_etcd_cert_file"),
        (config.pool_etcd_key_file, "pool_etcd_key_file"),
    )


class EtcdCredentials:
    """The files of etcd's TLS, read again for each session (module doc)."""

    def __init__(self, config: Config, first: ClientTls) -> None:
        self._config = config
        self.current = first
        self._failed = ""  # the last failed read's error, said once

    @classmethod
    def from_config(cls, config: Config) -> EtcdCredentials | None:
        """The files, read and checked now; None without ``pool_etcd_ca_file``."""
        first = etcd_tls(config)
        return None if first is None else cls(config, first)

    def fresh(self) -> ClientTls:
        """The files as they are now; the last good ones where a read fails."""
        try:
            tls = etcd_tls(self._config)
        except ConfigError as exc:
            if str(exc) != self._failed:
                self._failed = str(exc)
                log.warning(
                    "etcd TLS files not read; the last good ones stay in use",
                    extra={"error": str(exc)},
                )
            return self.current
        assert tls is not None, "pool_etcd_ca_file stays set"
        self.current, self._failed = tls, ""
        return tls


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no types
    """aetcd's client over a TLS channel (module doc)."""

    def __init__(self, host: str, port: int, tls: ClientTls, **options: Any) -> None:
        super().__init__(host, port, **options)
        self._credentials = tls.credentials()

    async def connect(self) -> None:
        """``aetcd.Client.connect``, with a TLS channel (and no etcd user)."""
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # another task connects: wait
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(
                target, self._credentials, options=list(self._options.items())
            )
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False
