"""Framed journal records read back through damage: a torn tail is dropped, a damaged
frame loses only itself, and what was skipped is counted."""
from __future__ import annotations

import pytest

from loraplex.platform.metering.frames import frame, read_records


def _segment(tmp_path, n: int = 5):
    """A segment of `n` records {"i": 0..n-1} (frames of equal size): its path, its bytes
    and the offset of each record's frame."""
    good = b"".join(frame({"i": i, "pad": "x" * 30}) for i in range(n))
    path = tmp_path / "usage-a-0.journal"
    path.write_bytes(good)
    size = len(good) // n
    return path, good, [k * size for k in range(n)]


def _ids(seg) -> list[int]:
    return [r["i"] for r in seg.records]


def test_a_torn_tail_is_dropped(tmp_path):
    path, good, _at = _segment(tmp_path)
    seg = read_records(path)
    assert _ids(seg) == list(range(5)) and seg.clean
    path.write_bytes(good[:-3])  # a crash mid-write: the last record is cut short
    seg = read_records(path)
    assert _ids(seg) == [0, 1, 2, 3] and seg.torn_bytes == len(good) // 5 - 3 and seg.skipped_bytes == 0
    damaged = bytearray(good)
    damaged[-5] ^= 0xFF  # damage in the last record: no valid frame after it either
    path.write_bytes(bytes(damaged))
    assert _ids(read_records(path)) == [0, 1, 2, 3]


@pytest.mark.parametrize("where", ["payload", "length", "checksum"])
def test_a_damaged_frame_mid_segment_loses_only_itself(tmp_path, where):
    """One corrupted byte in record 1 (its payload, length or checksum field): the reader
    finds the next valid frame and keeps every record after it, counting the loss."""
    path, good, at = _segment(tmp_path)
    size = len(good) // 5
    damaged = bytearray(good)
    damaged[at[1] + {"payload": 20, "length": 1, "checksum": 5}[where]] ^= 0x5A
    path.write_bytes(bytes(damaged))
    seg = read_records(path)
    assert _ids(seg) == [0, 2, 3, 4] and not seg.clean
    assert seg.skipped_bytes == size and seg.skipped_records == 1 and seg.torn_bytes == 0


def test_several_damaged_stretches_and_a_torn_tail(tmp_path):
    path, good, at = _segment(tmp_path, 9)
    size = len(good) // 9
    damaged = bytearray(good[:-2])
    for k in (2, 3, 6):  # two neighbours: one stretch of two records
        damaged[at[k] + 15] ^= 0x01
    path.write_bytes(bytes(damaged))
    seg = read_records(path)
    assert _ids(seg) == [0, 1, 4, 5, 7]
    assert seg.skipped_bytes == 3 * size and seg.skipped_records == 3 and seg.torn_bytes == size - 2
