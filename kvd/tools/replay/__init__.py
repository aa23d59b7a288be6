"""Trace replay: parse request traces and simulate eviction policies on them.

Offline tooling for choosing and checking the store's eviction policy
(``kvd.store.eviction.policy``) and for ``kvd bench``; the daemon never imports it.
"""

from kvd.tools.replay.sim import SimResult, belady, simulate, sweep, unbounded
from kvd.tools.replay.trace import Trace, TraceError, load_trace, parse_trace

__all__ = [
    "SimResult",
    "Trace",
    "TraceError",
    "belady",
    "load_trace",
    "parse_trace",
    "simulate",
    "sweep",
    "unbounded",
]
