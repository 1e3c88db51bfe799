"""The SSE response ends a stream whose client stopped reading, closing its source."""
from __future__ import annotations

import asyncio

from loraplex.platform.serving.streaming import SSEResponse


def test_a_client_that_stops_reading_ends_the_stream_and_closes_its_source():
    closed = asyncio.Event()
    sent: list[bytes] = []

    async def source():
        try:
            for i in range(10_000):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.set()

    async def main() -> None:
        connected = asyncio.Event()  # never set: the client neither reads nor leaves
        stalled = asyncio.Event()

        async def receive():
            await connected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                if len(sent) == 3:  # the socket's buffers are full: this write waits for a reader
                    stalled.set()
                    await asyncio.Event().wait()
                sent.append(message["body"])

        chunks = source()
        await asyncio.wait_for(SSEResponse(chunks, source=None, write_timeout=0.2)({}, receive, send), 60)
        assert stalled.is_set() and closed.is_set()

    asyncio.run(main())
    assert sent == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
