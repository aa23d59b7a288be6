"""Namespace patterns, as the token file and the settings name them: a
namespace itself, or a prefix ending in ``*`` (``team-a/*``; ``*`` alone:
every namespace)."""

from __future__ import annotations

from collections.abc import Iterable


def matches(patterns: Iterable[str], namespace: str) -> bool:
    """Whether ``namespace`` is one of ``patterns``."""
    for pattern in patterns:
        if pattern.endswith("*"):
            if namespace.startswith(pattern[:-1]):
                return True
        elif namespace == pattern:
            return True
    return False
