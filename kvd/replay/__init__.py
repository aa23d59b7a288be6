"""Trace replay: parse request traces and simulate eviction policies on them.

Offline tooling for choosing and checking the store's eviction policy
(``kvd.eviction``) and for ``kvd bench``; the daemon never imports it.
"""

from kvd.replay.sim import SimResult, belady, simulate, sweep, unbounded
from kvd.replay.trace import Trace, TraceError, load_trace, parse_trace

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
