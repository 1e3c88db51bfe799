"""`RemoteEngineClient`: the `EngineClient` of a gateway whose engines are remote workers.

Every generate is placed by the `WorkerPool` (adapter affinity with bounded load) and
streamed from the worker over HTTP/1.1 keep-alive (platform/fleet/WIRE.md). A worker that fails before
it sent any output is left and the request goes, once, to another; one that fails after
makes the stream raise `WorkerLostError` (the OpenAI layer sends an error event; the
gateway's metering sees the tokens already received). The stats each response carries,
and the health poller's, feed the pool; `stats()` sums the fleet.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import httpx
import orjson

from loraplex.engine.client import AdapterResidency, EngineStats, LaneDepth, ModelInfo
from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import EngineDeadError
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.engine.tokenizer import Tokenizer

from loraplex.platform.fleet.config import FleetConfig
from loraplex.platform.fleet.errors import (
    RETRYABLE,
    WorkerError,
    WorkerLostError,
    WorkerUnreachableError,
    error_from_body,
)
from loraplex.platform.fleet import wire
from loraplex.platform.observability.request_id import REQUEST_ID_HEADER, current_request_id
from loraplex.platform.observability.tracing import inject_trace_context
from loraplex.platform.routing import (
    HealthPoller,
    Lease,
    RouteRequest,
    StatsError,
    WorkerPool,
    WorkerStats,
    discovery_for,
)
from loraplex.platform.tenancy.adapter_directory import AdapterDirectory

log = logging.getLogger(__name__)

GENERATE = "/internal/v1/generate"
ABORT = "/internal/v1/abort"
STATS = "/internal/v1/stats"


class _Refused(Exception):
    """A worker refused a request before any output; `error` is what it said."""

    def __init__(self, error: Exception, stats: WorkerStats | None, transport: bool) -> None:
        super().__init__(str(error))
        self.error, self.stats, self.transport = error, stats, transport


class RemoteEngineClient:
    """Call `start()` inside the event loop before use and `aclose()` at exit (the app's
    lifespan does both); `generate` raises `NoCapacityError` (503 + Retry-After) when no
    worker can take the request."""

    def __init__(self, config: FleetConfig, info: ModelInfo, adapters: AdapterDirectory,
                 pool: WorkerPool | None = None) -> None:
        self.config = config
        self.info = info
        self.adapters = adapters
        self.pool = pool or WorkerPool(config.router)
        self._tokenizer = Tokenizer(info.model_dir)
        self._http: httpx.AsyncClient | None = None
        self._poller = HealthPoller(self.pool, discovery_for(config.workers, config.workers_dns), self._probe)
        self._poll_task: asyncio.Task | None = None
        self._placed: dict[str, str] = {}  # request id -> worker URL, while it runs
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.config.max_connections,
                              max_keepalive_connections=self.config.max_keepalive)
        timeout = httpx.Timeout(self.config.read_timeout_s, connect=self.config.connect_timeout_s)
        self._http = httpx.AsyncClient(headers=self.config.headers(), limits=limits, timeout=timeout)
        await self._poller.poll_once()
        self._poll_task = asyncio.create_task(self._poller.run(), name="loraplex-health-poller")

    async def aclose(self) -> None:
        self._closed = True
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
        self.adapters.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closed = True

    async def _probe(self, url: str) -> WorkerStats:
        resp = await self._client().get(url + STATS, timeout=self.config.router.health_timeout_s)
        resp.raise_for_status()
        return WorkerStats.from_json(orjson.loads(resp.content))

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise EngineDeadError("the remote engine client was not started")
        return self._http

    # -- the model -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def is_running(self) -> bool:
        return self._http is not None and not self._closed

    def model_info(self) -> ModelInfo:
        return self.info

    # -- adapters --------------------------------------------------------------------
    def resolve_adapter(self, name: str) -> AdapterRef:
        return self.adapters.resolve(name)

    def adapter_residency(self) -> AdapterResidency:
        device: set[str] = set()
        cpu: set[str] = set()
        for w in self.pool.workers():
            device |= w.stats.device_adapters
            cpu |= w.stats.cpu_adapters
        return AdapterResidency(tuple(sorted(device)), tuple(sorted(cpu - device)))

    def add_adapter(self, name: str, source: str | Path, *, replace: bool = False) -> AdapterRef:
        raise WorkerError("a gateway publishes adapters through its registry (admin API or `loraplex adapter "
                          "add`); workers fetch them from the shared adapter store by digest")

    def remove_adapter(self, name: str) -> None:
        raise WorkerError("a gateway removes adapters through its registry (admin API)")

    async def prefetch_adapter(self, ref: AdapterRef) -> None:
        raise WorkerError("a gateway's workers fetch adapter versions from the shared adapter store on first use")

    def drop_adapter(self, digest: str) -> bool:
        raise WorkerError("a gateway's workers keep their own adapter tiers")

    # -- stats -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The fleet's last reports summed (KV usage averaged over the accepting workers)."""
        views = self.pool.workers()
        waiting = {lane: 0 for lane in Lane}
        for v in views:
            for name, n in v.stats.waiting.items():
                lane = Lane.__members__.get(name.upper())
                if lane is not None:
                    waiting[lane] += n
        live = [v for v in views if v.accepting]
        return EngineStats(
            running=sum(v.stats.running for v in views), waiting=sum(waiting.values()),
            lanes={lane: LaneDepth(0, n) for lane, n in waiting.items()},
            kv_cache_usage=sum(v.stats.kv_usage for v in live) / len(live) if live else 0.0,
            device="fleet", adapters=self.adapter_residency(),
            max_loras=max((v.stats.max_loras for v in views), default=0))

    # -- requests --------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        url = self._placed.get(request_id)
        if url is not None and self._http is not None:
            asyncio.get_running_loop().create_task(self._abort(url, request_id))

    async def _abort(self, url: str, request_id: str) -> None:
        try:
            await self._client().post(url + ABORT, content=orjson.dumps({"request_id": request_id}))
        except httpx.HTTPError as exc:
            log.debug("abort of %s on %s failed: %r", request_id, url, exc)

    async def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                       request_id: str | None = None, lane: Lane = Lane.STANDARD,
                       adapter: AdapterRef | str | None = None, cache_salt: str = "", tenant: str = "",
                       tenant_weight: float = 1.0, timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        if self._closed:
            raise EngineDeadError("the gateway is shutting down")
        ids = self._tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = sampling or SamplingParams()
        ref = self.resolve_adapter(adapter) if isinstance(adapter, str) else adapter
        rid = request_id or uuid.uuid4().hex
        req = wire.GenerateRequest(rid, ids, sampling, lane, ref, cache_salt, tenant=tenant,
                                          tenant_weight=tenant_weight, timeout=timeout)
        payload = orjson.dumps(req.to_json())
        lease = self.pool.acquire(RouteRequest(adapter=ref.digest if ref is not None else None,
                                               prefix_key=req.prefix_key))
        stats: list[WorkerStats | None] = [None]  # the worker's latest report, set by _read
        retried = False
        try:
            while True:
                stats[0] = None  # a report from a worker that failed is not this one's
                got_output = False
                try:
                    resp = await self._send(lease, payload)
                    self._placed[rid] = lease.url
                    stats[0] = _header_stats(resp)
                    async with aclosing(self._read(resp, lease, rid, stats)) as outputs:
                        async for out in outputs:
                            got_output = True
                            yield out
                    return
                except _Refused as refused:
                    if retried or not isinstance(refused.error, RETRYABLE):
                        if refused.transport:
                            self.pool.fail(lease)
                        raise refused.error from None
                    lease = self._replace(lease, refused)
                except WorkerLostError:
                    if retried or got_output:
                        raise
                    lease = self.pool.acquire(lease.request, exclude=frozenset({lease.worker_id}))
                retried = True
        finally:
            self._placed.pop(rid, None)
            self.pool.release(lease, stats[0])

    def _replace(self, lease: Lease, refused: _Refused) -> Lease:
        """Another worker for a request `lease`'s worker refused before any output."""
        log.info("worker %s refused a request before any output (%s); trying another", lease.url, refused.error)
        if refused.transport:
            return self.pool.retry(lease)  # it leaves until a health check succeeds
        self.pool.release(lease, refused.stats)
        return self.pool.acquire(lease.request, exclude=frozenset({lease.worker_id}))

    async def _send(self, lease: Lease, payload: bytes) -> httpx.Response:
        client = self._client()
        headers = {"content-type": "application/json"}
        if (request_id := current_request_id()) is not None:
            headers[REQUEST_ID_HEADER] = request_id  # one id in the gateway's and the worker's logs
        inject_trace_context(headers)  # the worker's spans join the gateway's trace (tracing on)
        req = client.build_request("POST", lease.url + GENERATE, content=payload, headers=headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _Refused(WorkerUnreachableError(f"worker {lease.url} unreachable: {type(exc).__name__}"),
                           None, transport=True) from exc
        if resp.status_code == 200:
            return resp
        try:
            await resp.aread()
            body = orjson.loads(resp.content)
        except (httpx.HTTPError, orjson.JSONDecodeError):
            body = None
        finally:
            await resp.aclose()
        raise _Refused(error_from_body(body, resp.status_code), _header_stats(resp), transport=False)

    async def _read(self, resp: httpx.Response, lease: Lease, rid: str, stats: list[WorkerStats | None]
                    ) -> AsyncIterator[RequestOutput]:
        """The outputs of a worker's response; its stats lines land in `stats[0]`."""
        finished: bool | None = None  # None until the first output
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                kind, msg, out = _decode(line, rid)
                if out is not None:
                    finished = out.finished
                    yield out
                elif kind == "stats":
                    stats[0] = _stats_or_none(msg) or stats[0]
                elif kind == "error":
                    err = error_from_body(msg, 500)
                    if finished is None:  # nothing sent yet: another worker may take it
                        raise _Refused(err, stats[0], transport=False)
                    raise err
        except (httpx.HTTPError, _Malformed) as exc:
            self.pool.fail(lease)
            raise WorkerLostError(f"the engine worker serving this request failed ({type(exc).__name__})") from exc
        finally:
            await resp.aclose()
        if finished is not True:
            self.pool.fail(lease)
            raise WorkerLostError("the engine worker serving this request ended its response early")


class _Malformed(Exception):
    """A response line that is not the wire's."""


def _decode(line: str, rid: str) -> tuple[object, dict, RequestOutput | None]:
    try:
        msg = orjson.loads(line)
        kind = msg.get("type")
        return kind, msg, wire.output_from_json(rid, msg) if kind == "output" else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _Malformed(f"a malformed response line: {type(exc).__name__}") from None


def _header_stats(resp: httpx.Response) -> WorkerStats | None:
    raw = resp.headers.get(wire.STATS_HEADER)
    if not raw:
        return None
    try:
        return _stats_or_none(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


def _stats_or_none(doc: object) -> WorkerStats | None:
    try:
        return WorkerStats.from_json({k: v for k, v in doc.items() if k != "type"}) if isinstance(doc, dict) else None
    except StatsError as exc:
        log.warning("a worker sent malformed stats: %s", exc)
        return None
