"""The L2 SSD tier: record format, striped devices, and the segment log."""

from kvd.l2.devices import DeviceError, DeviceSet
from kvd.l2.records import ChecksumMismatch, L2Full, L2Record
from kvd.l2.tier import L2Tier

__all__ = ["ChecksumMismatch", "DeviceError", "DeviceSet", "L2Full", "L2Record", "L2Tier"]
