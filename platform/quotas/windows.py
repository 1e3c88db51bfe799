"""Fixed quota windows: the UTC minute (rpm, tpm), the UTC day or calendar month (budgets)."""
from __future__ import annotations

import calendar
import datetime as dt


def minute_start(now: float) -> int:
    return int(now // 60) * 60


def period_bounds(period: str, now: float) -> tuple[int, int]:
    """(start, end) unix seconds of the UTC day or calendar month holding `now`."""
    if period == "day":
        start = int(now // 86400) * 86400
        return start, start + 86400
    d = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    start = calendar.timegm((d.year, d.month, 1, 0, 0, 0))
    end = calendar.timegm((d.year + d.month // 12, d.month % 12 + 1, 1, 0, 0, 0))
    return start, end
