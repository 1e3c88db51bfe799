"""Framed records of a usage-journal segment, and reading them back through damage.

A record is framed `<length u32><crc32 u32><payload>` (the payload a JSON object), so a
torn tail (a crash mid-write) fails its length or checksum and is dropped; a damaged
frame in the middle (a bad sector, a flipped bit) loses only itself: the reader scans on
to the next frame whose length and checksum hold and keeps everything from there,
counting the bytes and records it skipped.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson

_FRAME = struct.Struct("<II")  # payload length, crc32(payload)
MAX_RECORD = 1 << 20  # a longer length field is damage, not a record


def frame(record: dict) -> bytes:
    payload = orjson.dumps(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass
class SegmentRead:
    """What one segment held: its records, what was skipped between them (damaged
    frames, each a stretch of `skipped_bytes`) and the torn tail dropped at the end."""

    records: list[dict] = field(default_factory=list)
    skipped_bytes: int = 0
    skipped_records: int = 0  # exact when the damaged frames' lengths survived, else one per stretch
    torn_bytes: int = 0

    @property
    def clean(self) -> bool:
        return not (self.skipped_bytes or self.torn_bytes)


def _frame_at(data: memoryview, pos: int) -> tuple[dict, int] | None:
    """The record framed at `pos` and the offset after it, or None if no valid frame
    starts there."""
    if pos + _FRAME.size > len(data):
        return None
    n, crc = _FRAME.unpack_from(data, pos)
    end = pos + _FRAME.size + n
    if n > MAX_RECORD or end > len(data):
        return None
    body = data[pos + _FRAME.size:end]
    if zlib.crc32(body) != crc:
        return None
    try:
        rec = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return (rec, end) if isinstance(rec, dict) else None


def _next_frame(data: memoryview, raw: bytes, pos: int) -> int | None:
    """The first offset after `pos` where a valid frame starts. Every payload is a JSON
    object, so only the bytes before a `{` are candidates (a cheap scan); a client's
    strings cannot forge a frame inside a payload, since JSON escapes the control bytes
    a small length field is made of."""
    at = raw.find(b"{", pos + 1 + _FRAME.size)
    while at != -1:
        if _frame_at(data, at - _FRAME.size) is not None:
            return at - _FRAME.size
        at = raw.find(b"{", at + 1)
    return None


def _frames_between(data: memoryview, start: int, end: int) -> int:
    """How many frames the damaged stretch [start, end) held: the length fields, followed
    from `start`, land exactly on `end` when only payload bytes were damaged."""
    pos, count = start, 0
    while pos < end and pos + _FRAME.size <= end:
        pos += _FRAME.size + _FRAME.unpack_from(data, pos)[0]
        count += 1
    return count if pos == end else 1


def read_records(path: Path) -> SegmentRead:
    """The records of one segment: a damaged frame is skipped up to the next valid one,
    a torn or damaged tail (no valid frame after it) dropped."""
    raw = path.read_bytes()
    data = memoryview(raw)
    out = SegmentRead()
    pos = 0
    while pos < len(data):
        got = _frame_at(data, pos)
        if got is not None:
            out.records.append(got[0])
            pos = got[1]
            continue
        nxt = _next_frame(data, raw, pos)
        if nxt is None:
            out.torn_bytes = len(data) - pos
            break
        out.skipped_bytes += nxt - pos
        out.skipped_records += _frames_between(data, pos, nxt)
        pos = nxt
    return out
