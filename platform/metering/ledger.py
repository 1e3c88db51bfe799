"""Crash-safe metering: what goes into the usage journal, and recovery from it.

Two kinds of journal record, each the usage event as it would be billed at that moment
plus the quota charges to settle (None when the request holds no lease):

- a checkpoint ("c") of a running request: the prompt tokens the engine processed and
  the completion tokens already handed to the client, status "error". Written when a
  request's first output arrives (before it is sent: a client never sees output whose
  prompt is not billed) and then when both `checkpoint_tokens` tokens and
  `checkpoint_seconds` seconds have passed since the previous one; the token that
  triggers it waits for the fsync. A crash thus bills a request at most
  max(checkpoint_tokens, 1 + the tokens it streamed in the last checkpoint_seconds)
  output tokens less than its client received, and never more.
- a final event ("e"): written at finish; the request is acknowledged (its hook returns)
  once it is durable.

A record pins its journal segment until it is safe elsewhere: a final event until the
database has it and its settlement went through, a checkpoint until a newer checkpoint
or the final event replaces it. Recovery (`recover`, at start) claims the journals of
dead processes: per request, its final event if one was written, else its last
checkpoint becomes its final event. These are journalled again in this process's own
journal (fsync'd) before the dead one is deleted, then written to the database and
settled, both idempotent (a unique request id, a lease deleted at settlement): a crash
at any point of recovery replays again and counts nothing twice.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from loraplex.platform.metering.journal import Journal
from loraplex.platform.metering.writer import Event, UsageWriter
from loraplex.platform.quotas.admission import Charges, Reservation, charges_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JournalConfig:
    """Where the usage journal lives and how often running requests checkpoint."""

    directory: Path
    checkpoint_tokens: int = 16
    checkpoint_seconds: float = 1.0
    max_segment_bytes: int = 8 << 20


@dataclass
class _Progress:
    tokens: int = -1  # completion tokens in the last checkpoint; -1: none yet
    at: float = 0.0  # monotonic time of the last checkpoint
    segment: int | None = None  # where the last checkpoint is (pinned)


def record(kind: str, event: Event, charges: Charges | None) -> dict:
    return {"k": kind, "e": asdict(event), "r": charges}


def final_events(records) -> list[tuple[Event, Charges | None]]:
    """Per request id: its final event if one was written, else its last checkpoint."""
    last: dict[str, dict] = {}
    for r in records:
        rid = r["e"]["request_id"]
        if r["k"] == "e" or last.get(rid, {}).get("k") != "e":
            last[rid] = r
    return [(Event(**r["e"]), charges_of(r["r"]) if r.get("r") else None) for r in last.values()]


class Ledger:
    """The journal side of one process's metering."""

    def __init__(self, journal: Journal, writer: UsageWriter, settle: Callable[[Reservation, int], None],
                 config: JournalConfig) -> None:
        self.journal = journal
        self.writer = writer
        self.settle = settle
        self.config = config
        self._open: dict[str, _Progress] = {}
        self.checkpoints = 0
        self.recovered = 0
        self.skipped_bytes = 0  # damaged journal bytes skipped at recovery
        self.skipped_records = 0

    # -- running requests ---------------------------------------------------------------
    def due(self, request_id: str, delivered: int, now: float) -> bool:
        """Whether a request that has handed `delivered` tokens to its client checkpoints
        before the next one (cheap: called for every token)."""
        p = self._open.get(request_id)
        if p is None:
            p = self._open[request_id] = _Progress()
        if p.tokens < 0:
            return True
        return delivered - p.tokens >= self.config.checkpoint_tokens and now - p.at >= self.config.checkpoint_seconds

    def checkpoint(self, event: Event, charges: Charges | None, now: float) -> int:
        """Journal a running request's usage so far; returns the lsn to wait for."""
        lsn, seg = self.journal.append(record("c", event, charges), pins=1)
        p = self._open.setdefault(event.request_id, _Progress())
        old, p.tokens, p.at, p.segment = p.segment, event.completion_tokens, now, seg
        if old is not None:
            self.journal.unpin(old)
        self.checkpoints += 1
        return lsn

    def finish(self, event: Event, charges: Charges | None) -> tuple[int, int]:
        """Journal a request's final event and queue it for the database; returns (lsn,
        segment). The segment stays pinned once more when `charges` is given, until
        `settled(segment)`: the caller settles (inline, or through the writer)."""
        lsn, seg = self.journal.append(record("e", event, charges), pins=2 if charges else 1)
        p = self._open.pop(event.request_id, None)
        if p is not None and p.segment is not None:
            self.journal.unpin(p.segment)
        self.writer.submit(event, seg)
        return lsn, seg

    def settled(self, segment: int) -> None:
        self.journal.unpin(segment)

    def forget(self, request_id: str) -> None:
        """A request that ends without an event (not admitted after all)."""
        p = self._open.pop(request_id, None)
        if p is not None and p.segment is not None:
            self.journal.unpin(p.segment)

    # -- recovery -----------------------------------------------------------------------
    def recover(self) -> int:
        """Claim dead processes' journals (see the module docstring); returns the events
        recovered. Runs before serving, off the event loop."""
        total = 0
        for orphan in self.journal.orphans():
            try:
                events = final_events(orphan.records())
                lsn = 0
                queued = []
                for event, charges in events:
                    lsn, seg = self.journal.append(record("e", event, charges), pins=2 if charges else 1)
                    queued.append((event, charges, seg))
                if lsn and not self.journal.wait_durable(lsn):
                    raise OSError(f"the usage journal {self.journal.dir} cannot be written")
            except Exception:
                log.exception("recovering the usage journal of %s failed; kept for the next start", orphan.owner)
                orphan.release(delete=False)
                continue
            orphan.release(delete=True)
            self.skipped_bytes += orphan.skipped_bytes
            self.skipped_records += orphan.skipped_records
            for event, charges, seg in queued:
                self.writer.submit(event, seg)
                if charges:
                    res = Reservation(event.request_id, charges, True)
                    used = event.total_tokens
                    self.writer.submit_op(lambda res=res, used=used: self.settle(res, used), seg)
            total += len(events)
            log.warning("recovered %d usage events from the journal of a stopped process (%s)",
                        len(events), orphan.owner)
        self.recovered += total
        return total
