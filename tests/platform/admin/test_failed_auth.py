"""Failed admin authentications aggregated per window, on a real event loop: the first of a
window is a row at once, the rest one row when the window ends, and the next failure after
it opens a window of its own."""
from __future__ import annotations

import asyncio

from loraplex.platform.admin.failed_auth import SAMPLE, FailureAudit


class Rows(list):
    """The audit rows written, as (action, target, details)."""

    async def write(self, actor: str, action: str, target: str, details: dict) -> None:
        assert actor == "anonymous"
        self.append((action, target, details))


async def _until(condition, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


def test_a_window_is_its_first_failure_at_once_then_one_row_for_the_rest():
    async def main() -> Rows:
        rows = Rows()
        audit = FailureAudit(rows.write, window=3600)
        audit.failed("session.failed", "10.0.0.1", "wrong token")
        await _until(lambda: len(rows) == 1)
        for i in range(2, 30):
            audit.failed("session.failed", f"10.0.0.{i}", f"wrong token {i}")
        audit.failed("session.failed", "10.0.0.2", "again")  # an address counted once
        await asyncio.sleep(0.05)
        assert len(rows) == 1, "the rest waits for the window's end"
        await audit.close()  # ends the hour-long window now
        return rows

    rows = asyncio.run(main())
    assert rows[0] == ("session.failed", "client:10.0.0.1", {"reason": "wrong token"})
    action, target, d = rows[1]
    assert (action, target, d["count"], d["distinct_clients"]) == ("session.failed", "clients:28", 29, 28)
    assert d["clients"] == sorted(f"10.0.0.{i}" for i in range(2, 30))[:SAMPLE] and d["reason"] == "again"
    assert d["window_seconds"] == 3600 and len(rows) == 2


def test_after_a_window_ends_the_next_failure_opens_one_and_is_a_row_at_once():
    async def main() -> Rows:
        rows = Rows()
        audit = FailureAudit(rows.write, window=0.05)
        audit.failed("admin.bearer_failed", "10.0.0.1", "r")
        audit.failed("admin.bearer_failed", "10.0.0.1", "r")
        await _until(lambda: len(rows) == 2)  # the first, then the window's end
        audit.failed("admin.bearer_failed", "10.0.0.9", "r")
        await _until(lambda: len(rows) == 3)
        await audit.close()
        return rows

    rows = asyncio.run(main())
    assert [t for _, t, _ in rows] == ["client:10.0.0.1", "client:10.0.0.1", "client:10.0.0.9"]
    assert rows[1][2]["count"] == 1 and "count" not in rows[2][2]


def test_actions_have_windows_of_their_own_and_close_writes_those_still_open():
    async def main() -> Rows:
        rows = Rows()
        audit = FailureAudit(rows.write, window=3600)
        audit.failed("session.failed", None, "a")
        audit.failed("admin.bearer_failed", "10.0.0.1", "b")
        audit.failed("admin.bearer_failed", "10.0.0.2", "c")
        await _until(lambda: len(rows) == 2)
        await audit.close()  # the hour-long windows end now: one has a count to write
        return rows

    rows = asyncio.run(main())
    assert rows[:2] == [("session.failed", "client:unknown", {"reason": "a"}),
                        ("admin.bearer_failed", "client:10.0.0.1", {"reason": "b"})]
    assert len(rows) == 3 and rows[2][:2] == ("admin.bearer_failed", "client:10.0.0.2") and rows[2][2]["count"] == 1


def test_a_failing_write_is_logged_not_raised(caplog):
    async def broken(*_args) -> None:
        raise RuntimeError("database down")

    async def main() -> None:
        audit = FailureAudit(broken, window=3600)
        audit.failed("session.failed", "10.0.0.1", "r")
        audit.failed("session.failed", "10.0.0.2", "r")
        await audit.close()

    asyncio.run(main())
    assert caplog.text.count("writing the audit row for session.failed failed") == 2
