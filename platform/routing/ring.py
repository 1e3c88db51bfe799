"""A consistent-hash ring over worker ids (virtual nodes, stable 64-bit hashes)."""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence

from loraplex.platform.routing.view import stable_hash


class HashRing:
    """Every gateway that builds a ring from the same ids walks it in the same order,
    so an adapter has the same home worker behind every gateway replica."""

    def __init__(self, worker_ids: Sequence[str], vnodes: int) -> None:
        points = sorted((stable_hash(f"{wid}#{i}"), wid) for wid in worker_ids for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._ids = [wid for _, wid in points]
        self._n = len(set(worker_ids))

    def walk(self, key: str) -> Iterator[str]:
        """Distinct workers clockwise from `key`'s point: the home first, then its spills."""
        total = len(self._ids)
        if total == 0:
            return
        start = bisect_right(self._hashes, stable_hash(key))
        seen: set[str] = set()
        for i in range(total):
            wid = self._ids[(start + i) % total]
            if wid not in seen:
                seen.add(wid)
                yield wid
                if len(seen) == self._n:
                    return
