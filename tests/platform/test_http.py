from __future__ import annotations

import asyncio

import pytest

from loraplex.platform.http import ClientDisconnected, send_within


async def _writer(sent: list[int]) -> None:
    async def send(message: int) -> None:
        await asyncio.sleep(0)  # one turn of the loop, as a write that lets others run does
        sent.append(message)

    for n in range(1000):  # a long stream, ended early only by the cancel
        await send_within(send, n, timeout=30)


@pytest.mark.parametrize("ticks", range(6))
def test_a_cancel_that_lands_as_a_send_completes_is_not_swallowed(ticks):
    """The stream writer is cancelled when its client leaves. `asyncio.wait_for` (Python <
    3.12) returns the send's result instead of raising if the send finished in the same
    loop turn as the cancel, and the writer then ran the whole generation to its end."""
    async def run() -> list[int]:
        sent: list[int] = []
        task = asyncio.ensure_future(_writer(sent))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sent

    sent = asyncio.run(run())
    assert len(sent) <= ticks


def test_a_send_that_waits_past_the_timeout_is_a_disconnect():
    async def run() -> bool:
        stuck = asyncio.Event()
        cancelled = []

        async def send(message: int) -> None:
            try:
                await stuck.wait()  # a client that stopped reading: the write never drains
            except asyncio.CancelledError:
                cancelled.append(message)
                raise

        with pytest.raises(ClientDisconnected):
            await send_within(send, 7, timeout=0.01)
        return cancelled == [7]

    assert asyncio.run(run())


def test_a_send_that_fails_raises_its_error():
    async def send(message: int) -> None:
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        asyncio.run(send_within(send, 1, timeout=1))
