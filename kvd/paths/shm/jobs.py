"""The copies of region ops (``kvd.paths.ops.region_ops``): a job per item
between a region's span and the pool's pages, run on the loop or on copy
threads, and the deadline check of a batch. Bytes only: no results, no
protobuf, no grpc."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvd.io.backend import CopyMany
from kvd.paths.shm.regions import copy_from_pages, copy_to_pages, xxh3_of


def is_late(deadline_ns: int) -> bool:
    """Whether a client's deadline (``deadline_ns``, on this daemon's
    CLOCK_MONOTONIC; 0: none) has passed: the client may be writing other
    bytes into the room it gave, or reading them from it, by now."""
    return deadline_ns != 0 and time.monotonic_ns() >= deadline_ns


@dataclass(eq=False)
class CopyJob:
    """One item's copy: ``span`` of the region and the pool ``views``."""

    index: int
    span: np.ndarray[Any, np.dtype[np.uint8]]
    views: list[memoryview]
    held_bytes: int
    checksum: int = 0


def run_jobs(jobs: list[CopyJob], to_pages: bool, native: CopyMany | None = None) -> None:
    """Copy and checksum ``jobs``: in one call of ``native``
    (``kvd.io.backend.native_copy_many``) when given, else item by item with
    numpy and xxhash."""
    if native is not None:
        checksums = native([(job.span, job.views) for job in jobs], to_pages)
        for job, checksum in zip(jobs, checksums, strict=True):
            job.checksum = checksum
        return
    for job in jobs:
        if to_pages:
            job.checksum = copy_to_pages(job.span, job.views)
        else:
            job.checksum = copy_from_pages(job.views, job.span)


def hash_job(job: CopyJob, to_pages: bool) -> None:
    """The checksum of a job's bytes where they landed (after a split copy)."""
    job.checksum = xxh3_of(job.views if to_pages else [job.span.data])


async def all_done(copies: Iterable[Awaitable[None]]) -> None:
    """Wait for every copy, then raise the first failure: a copy still running
    touches pages that must stay pinned until it stops."""
    for result in await asyncio.gather(*copies, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result


def grouped(jobs: list[CopyJob], groups: int) -> list[list[CopyJob]]:
    """Split jobs into at most ``groups`` lists of about equal bytes, largest first."""
    buckets: list[list[CopyJob]] = [[] for _ in range(groups)]
    loads = [0] * groups
    for job in sorted(jobs, key=lambda j: -len(j.span)):
        i = loads.index(min(loads))
        buckets[i].append(job)
        loads[i] += len(job.span)
    return [bucket for bucket in buckets if bucket]
