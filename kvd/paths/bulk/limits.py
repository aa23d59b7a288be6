"""The limits of the bulk framing's servers, the bulk TCP port
(``kvd.paths.bulk.server``) and the shm socket (``kvd.paths.shm.channel``):
connections, bytes in flight, frame, idle and HELLO timeouts. Their
defaults are the settings' (``from_config``), the only ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd.config.settings import Config


@dataclass(frozen=True)
class BulkLimits:
    """The bulk port's limits; their defaults are the settings' (``from_config``)."""

    max_connections: int
    inflight_bytes: int
    frame_timeout_s: float
    idle_timeout_s: float
    max_connections_per_peer: int
    max_unauthenticated: int
    hello_timeout_s: float

    @classmethod
    def from_config(cls, config: Config) -> BulkLimits:
        return cls(
            max_connections=config.bulk_max_connections,
            inflight_bytes=config.bulk_inflight_bytes,
            frame_timeout_s=config.bulk_frame_timeout_ms / 1000,
            idle_timeout_s=config.bulk_idle_timeout_ms / 1000,
            max_connections_per_peer=config.bulk_max_connections_per_peer,
            max_unauthenticated=config.bulk_max_unauthenticated,
            hello_timeout_s=config.bulk_hello_timeout_ms / 1000,
        )
