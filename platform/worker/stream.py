"""One generate's life: the relay from the engine, and the NDJSON response to the gateway.

The relay pumps the engine's outputs into a buffer; the writer sends whatever the buffer
holds (one line per run of a choice when n > 1), so a client that reads slower than the
engine steps gets several steps coalesced into a line (never a step split across lines), and the engine never
waits for the network. The client closing the connection cancels the relay, which
aborts the request in the engine at once. A client that stays connected but stops
reading is bounded too: past `MAX_STREAM_BACKLOG` buffered outputs the request is
aborted (the stream ends with a StreamStalledError line), and a write that waits longer
than `STREAM_WRITE_TIMEOUT` ends the response as if the client had left. Before that, past
`PAUSE_BACKLOG` buffered outputs, or once the writer has left outputs in the buffer for
`STALL_SECONDS` (blocked sending to a client that stopped reading), the relay stops taking
outputs until the writer drains the buffer, and the engine pauses the request
(async_engine.py): a client that falls behind costs the batch nothing while it catches up.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING

from loraplex.engine.async_engine import MAX_STREAM_BACKLOG, PAUSE_BACKLOG, STALL_SECONDS
from loraplex.engine.client import EngineClient
from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import StreamStalledError

from loraplex.platform.lanes import lane_name
from loraplex.platform.observability.request_observer import RequestObserver
from loraplex.platform.http import STREAM_WRITE_TIMEOUT, ClientDisconnected, send_within
from loraplex.platform.fleet.errors import error_status
from loraplex.platform.fleet.wire import NDJSON, GenerateRequest, coalesce_choices, dumps_line, output_to_json

if TYPE_CHECKING:
    from loraplex.platform.worker.state import WorkerState

log = logging.getLogger(__name__)


class Relay:
    """Pumps one request's outputs from the engine into a buffer, keeping its metrics."""

    def __init__(self, state: WorkerState, req: GenerateRequest) -> None:
        self.state, self.req = state, req
        self.adapter = req.adapter.name if req.adapter is not None else None
        self.error: BaseException | None = None
        self.aborted = False
        self.done = False
        self.last: RequestOutput | None = None
        self._buf: list[RequestOutput] = []
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()  # the writer took the buffer
        self._pending_since = 0.0  # when the buffer last went from empty to holding outputs
        self._task: asyncio.Task | None = None

    def start(self, engine: EngineClient) -> None:
        if self.aborted:  # aborted while its adapter was fetched: it never reaches the engine
            self.done = True
            self._ready.set()
            return
        r = self.req
        stream = engine.generate(r.prompt_token_ids, r.sampling, request_id=r.request_id, lane=r.lane,
                                 adapter=r.adapter, cache_salt=r.cache_salt, tenant=r.tenant,
                                 tenant_weight=r.tenant_weight, timeout=r.timeout)
        self._task = asyncio.ensure_future(self._pump(stream))

    async def _pump(self, stream) -> None:
        lane = self.req.lane
        # Started in the request's context: its spans carry the gateway's x-request-id and
        # continue the gateway's trace (its traceparent).
        trace = self.state.tracing.start_request(lane=lane_name(lane), adapter=self.adapter, tenant=self.req.tenant,
                                                 adapter_digest=self.req.adapter.digest if self.req.adapter else None)
        obs = RequestObserver(self.state.metrics, trace, self.adapter, lane)
        reason = None
        try:
            async with aclosing(stream):
                async for out in stream:
                    obs.output(out)
                    reason = out.finish_reason if out.finished else None
                    self.last = out
                    if not self._buf:
                        self._pending_since = time.monotonic()
                    self._buf.append(out)
                    self._ready.set()
                    if len(self._buf) > MAX_STREAM_BACKLOG:
                        raise StreamStalledError(f"the reader of request {self.req.request_id} fell more than "
                                                 f"{MAX_STREAM_BACKLOG} outputs behind; the request was aborted")
                    if len(self._buf) >= PAUSE_BACKLOG or time.monotonic() - self._pending_since >= STALL_SECONDS:
                        self._drained.clear()
                        await self._drained.wait()
        except asyncio.CancelledError:
            reason = "abort"
            raise
        except StreamStalledError as exc:
            reason, self.error = "abort", exc
        except Exception as exc:  # noqa: BLE001 - the engine refused or failed this request
            reason, self.error = "error", exc
        finally:
            self.done = True
            self._ready.set()
            obs.finish(reason or "abort")
            final = self.last
            trace.end(finish_reason=reason or "abort", prompt_tokens=final.num_prompt_tokens if final else None,
                      output_tokens=final.num_output_tokens if final else None)

    @property
    def pending(self) -> bool:
        """Outputs wait in the buffer (a take() returns at once)."""
        return bool(self._buf)

    async def take(self) -> list[RequestOutput]:
        """The outputs produced since the last take (waits for at least one, or the end)."""
        await self._ready.wait()
        self._ready.clear()
        items, self._buf = self._buf, []
        self._drained.set()
        return items

    def abort(self) -> None:
        """End the request now; the stream ends with a finished `abort` output."""
        self.aborted = True
        self.cancel()

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def abort_output(self) -> RequestOutput:
        last = self.last
        return RequestOutput(self.req.request_id, [], "", True, "abort",
                             last.num_prompt_tokens if last else 0, last.num_cached_tokens if last else 0,
                             last.num_output_tokens if last else 0)


class NdjsonResponse:
    """The 200 stream: output lines, then a stats line (or an error line on a failure)."""

    def __init__(self, state: WorkerState, relay: Relay, first: list[RequestOutput], watcher: asyncio.Future,
                 headers: Mapping[str, str]) -> None:
        self.state, self.relay, self.first, self.watcher = state, relay, first, watcher
        self.headers = [(k.encode(), v.encode()) for k, v in {"content-type": NDJSON, **headers}.items()]

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        try:
            await asyncio.wait({writer, self.watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():  # the client left: abort in the engine, stop writing
                self.relay.cancel()
                writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            failed = None if writer.cancelled() else writer.exception()
            if failed is not None and not isinstance(failed, (OSError, ClientDisconnected)):  # the client left
                log.error("streaming %s failed", self.relay.req.request_id, exc_info=failed)
        finally:
            self.watcher.cancel()
            self.relay.cancel()
            self.state.relays.pop(self.relay.req.request_id, None)
            self.state.end()

    async def _write(self, raw_send) -> None:
        async def send(message: dict) -> None:
            await send_within(raw_send, message, STREAM_WRITE_TIMEOUT)  # stopped reading: treated as gone

        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        relay, items = self.relay, self.first
        while True:
            if items:
                outs = coalesce_choices(items)
                body = b"".join(dumps_line(output_to_json(out)) for out in outs)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if outs[-1].finished:
                    break
            if relay.done and not relay.pending:
                await send({"type": "http.response.body", "body": self._end_line(), "more_body": True})
                if relay.error is not None:
                    await send({"type": "http.response.body", "body": b""})
                    return
                break
            items = await relay.take()
        stats = {"type": "stats", **self.state.stats().to_json()}
        await send({"type": "http.response.body", "body": dumps_line(stats)})

    def _end_line(self) -> bytes:
        """What ends a stream whose last output was not finished: an abort, or an error."""
        if self.relay.error is None:
            return dumps_line(output_to_json(self.relay.abort_output()))
        _, body = error_status(self.relay.error)
        return dumps_line({"type": "error", **body})
