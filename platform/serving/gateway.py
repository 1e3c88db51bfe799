"""The gateway's per-request core, shared by every route: model resolution, lanes,
admission hooks, metrics, and the engine call. `Gateway.handle` takes one generation
call from parsing to its output stream; the routes only speak HTTP around it.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass

from loraplex.engine.client import EngineClient
from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import EngineDeadError, InvalidRequestError, StreamStalledError
from loraplex.engine.mixtures import is_mixture, mixture_name, mixture_ref, parse_adapters_field, parse_mixture
from loraplex.engine.request import AdapterRef, Lane

from loraplex.platform.serving.auth import Authenticator, Principal
from loraplex.platform.errors import BadRequestError, ModelNotFoundError, RegistryUnavailableError, ShuttingDownError
from loraplex.platform.lanes import lane_name, parse_lane
from loraplex.platform.observability.request_observer import RequestObserver
from loraplex.platform.observability.tracing import Tracing, TracingConfig
from loraplex.platform.serving.gaie import lower_lane, objective_lane, parse_objective
from loraplex.platform.serving.hooks import Hooks, RequestContext
from loraplex.platform.metrics import Metrics
from loraplex.platform.serving.prompt_batch import PromptTally, merge_prompt_streams
from loraplex.platform.serving.parse_pool import ParsePool
from loraplex.platform.serving.protocol import GenRequest, parse_chat, parse_completion, screen_request
from loraplex.platform.serving.request_limits import BodyBudget, check_choices, parse_request_json
from loraplex.platform.serving.render import TokenText
from loraplex.platform.settings import Settings

LANE_HEADER = "x-loraplex-lane"
ADAPTER_REF_TTL = 1.0  # seconds an adapter name -> version (digest) lookup is reused
# Name lookups may query the shared registry: on threads of their own (one in flight per
# name), never the event loop, and a request waits at most this long for one (then 503).
ADAPTER_LOOKUP_THREADS = 2
ADAPTER_LOOKUP_TIMEOUT = 5.0


@dataclass(frozen=True)
class Call:
    """One generation call as HTTP delivered it; `read_body` reads the body within its
    size limit, charged to the tenant's byte budget (it needs the caller's tenant)."""

    chat: bool
    authorization: str | None
    client: str | None  # the caller's address (throttling of failed keys)
    read_body: Callable[[Principal], Awaitable[bytes]]
    path_adapter: str | None = None  # /adapters/{adapter}/v1/...
    lane: str | None = None  # the LANE_HEADER
    objective: str | None = None  # a GAIE objective header


class Gateway:
    def __init__(self, settings: Settings, engine: EngineClient, auth: Authenticator, metrics: Metrics,
                 hooks: Hooks | None = None, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing or Tracing(TracingConfig())
        self.engine = engine
        self.auth = auth
        self.metrics = metrics
        self.hooks = hooks
        self.model_name = settings.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.token_text = TokenText(self.tokenizer)
        self.draining = False
        self.started_at = int(time.time())
        self._adapter_refs: dict[str, tuple[AdapterRef, float]] = {}
        self._lookups: dict[str, asyncio.Future] = {}
        self._lookup_pool = ThreadPoolExecutor(ADAPTER_LOOKUP_THREADS, thread_name_prefix="loraplex-adapter-lookup")
        self.objectives = {name: parse_objective(v) for name, v in settings.inference_objectives}
        limits = settings.limits
        self.body_budget = BodyBudget(limits.body_bytes_per_second, limits.max_body_bytes)

    # -- resolution -----------------------------------------------------------------
    def resolve_model(self, principal: Principal, model: object, path_adapter: str | None,
                      adapters: object = None) -> str | None:
        """The adapter a request runs with (None: the base model): the URL's, the model's,
        or the mixture the `adapters` extension names (engine/mixtures.py; a mixture may
        also be spelled as the URL's or the model's adapter, "a*0.7+b*0.3"), by its
        canonical name. Unknown and not-allowed adapters get the same 404, so a tenant
        cannot probe for another's adapters; a mixture needs every component allowed."""
        base = path_adapter is None and model in (None, "", self.model_name)
        if adapters is not None:
            if not base:
                raise BadRequestError("adapters names the adapters to mix: send it with the base model as model "
                                      "(or no model), not with an adapter in model or the URL", "adapters")
            return self._allowed_mixture(principal, parse_adapters_field, adapters, "adapters")
        if base:
            return None
        name = path_adapter if path_adapter is not None else model
        if is_mixture(name):
            return self._allowed_mixture(principal, parse_mixture, name, "model")
        if not isinstance(name, str) or name not in principal.adapters:
            raise ModelNotFoundError(str(name))
        return name

    @staticmethod
    def _allowed_mixture(principal: Principal, parse: Callable[[object], tuple], spec: object, param: str) -> str:
        try:
            components = parse(spec)
        except InvalidRequestError as exc:
            raise BadRequestError(str(exc), param) from None
        for name, _ in components:
            if name not in principal.adapters:
                raise ModelNotFoundError(name)
        return mixture_name(components)

    def lane_for(self, principal: Principal, header: str | None, priority: object, objective: str | None) -> Lane:
        """The request's lane: what its key allows (a 403 when asked for more), lowered by
        a GAIE objective where the tenant may use the lower lane."""
        lane = principal.lane_for(self.requested_lane(header, priority))
        return lower_lane(lane, objective_lane(objective, self.objectives), principal.allowed_lanes)

    @staticmethod
    def requested_lane(header: str | None, priority: object) -> Lane | None:
        lanes = []
        if header:
            lanes.append(parse_lane(header, LANE_HEADER))
        if priority is not None:
            lanes.append(parse_lane(priority, "priority"))
        return max(lanes) if lanes else None  # both given: the lower of the two

    def check_serving(self) -> None:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica")
        if not self.engine.is_running:
            raise EngineDeadError("the engine is not running")

    # -- one call ---------------------------------------------------------------------
    async def handle(self, call: Call, pool: ParsePool
                     ) -> tuple[RequestContext, GenRequest, AsyncIterator[RequestOutput]]:
        """parse -> admit -> run: who asks, for which model and lane, with which request
        (request_limits.py bounds what each step may cost before admission; tokenizing
        and chat templates run on `pool`); then the request's context and output stream,
        which admits (quotas) before the engine sees the request."""
        principal = await self.auth.authenticate(call.authorization, call.client)
        self.check_serving()
        limits = self.settings.limits
        raw = await call.read_body(principal)
        body = await pool.parse(raw, parse_request_json, limits, call.chat, self.max_model_len,
                                self.tokenizer.max_token_chars, screen_with=screen_request)
        adapter = self.resolve_model(principal, body.get("model"), call.path_adapter, body.get("adapters"))
        lane = self.lane_for(principal, call.lane, body.get("priority"), call.objective)
        req = await pool.run(parse_chat if call.chat else parse_completion, body, self.tokenizer, self.max_model_len)
        check_choices(req.num_sequences, limits)
        ref = await self.resolve_adapter_ref(adapter)  # may query the registry: off the event loop
        ctx, stream = self._start(principal, req, adapter, lane, "chatcmpl" if call.chat else "cmpl", ref)
        return ctx, req, stream

    # -- the engine call -------------------------------------------------------------
    def _start(self, principal: Principal, req: GenRequest, adapter: str | None, lane: Lane,
               prefix: str, ref: AdapterRef | None = None) -> tuple[RequestContext, AsyncIterator[RequestOutput]]:
        """The request's context and output stream. Nothing happens until the stream is
        first awaited: admission runs then, so a stream never started was never admitted.
        `ref`: the adapter's version from `resolve_adapter_ref` (else looked up here)."""
        self.check_serving()
        ctx = RequestContext(f"{prefix}-{uuid.uuid4().hex}", principal, adapter or self.model_name, adapter,
                             lane, sum(map(len, req.prompts)), req.sampling.max_tokens * req.num_sequences)
        if ref is None and adapter is not None:
            ref = self.adapter_ref(adapter)
        if ref is not None:
            ctx.adapter_digest = ref.digest
        return ctx, self._run(ctx, req, ref)

    def forget_adapter_refs(self) -> None:
        """Resolve adapter names afresh from now on (the admin API replaced or removed one)."""
        self._adapter_refs.clear()

    def adapter_ref(self, name: str) -> AdapterRef | None:
        """The adapter's current version, resolved here (not on the engine thread) so the
        version metered is the version run; reused for ADAPTER_REF_TTL seconds. Blocking:
        the event loop calls `resolve_adapter_ref` instead."""
        if is_mixture(name):
            return _mixture_of([(self.adapter_ref(n), w) for n, w in parse_mixture(name)])
        hit = self._adapter_refs.get(name)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        ref = self.engine.resolve_adapter(name)  # UnknownAdapterError (404) for a name it does not know
        if ref is None:
            return None  # an engine without adapters refuses the request itself
        if len(self._adapter_refs) > 10_000:
            self._adapter_refs.clear()
        self._adapter_refs[name] = (ref, time.monotonic() + ADAPTER_REF_TTL)
        return ref

    async def resolve_adapter_ref(self, name: str | None) -> AdapterRef | None:
        """`adapter_ref` off the event loop: on the lookup threads, one lookup per name in
        flight, RegistryUnavailableError (503) past ADAPTER_LOOKUP_TIMEOUT."""
        if name is None:
            return None
        if is_mixture(name):  # each component's version, as a lone adapter's
            return _mixture_of([(await self.resolve_adapter_ref(n), w) for n, w in parse_mixture(name)])
        hit = self._adapter_refs.get(name)
        if hit is not None and hit[1] > time.monotonic():
            return hit[0]
        lookup = self._lookups.get(name)
        if lookup is None:
            lookup = asyncio.get_running_loop().run_in_executor(self._lookup_pool, self.adapter_ref, name)
            self._lookups[name] = lookup
            lookup.add_done_callback(lambda f, n=name: self._lookups.pop(n, None) if self._lookups.get(n) is f
                                     else None)
        try:
            return await asyncio.wait_for(asyncio.shield(lookup), ADAPTER_LOOKUP_TIMEOUT)
        except asyncio.TimeoutError:
            raise RegistryUnavailableError(f"the adapter {name!r} could not be resolved within "
                                           f"{ADAPTER_LOOKUP_TIMEOUT:g} s; retry shortly") from None

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, ctx: RequestContext, req: GenRequest, ref: AdapterRef | None = None
                   ) -> AsyncIterator[RequestOutput]:
        trace = self.tracing.start_request(lane=lane_name(ctx.lane), adapter=ctx.adapter, model=ctx.model)
        if self.hooks is not None:
            try:
                with trace.span("admission"):
                    await self.hooks.admit(ctx)  # may raise RateLimitedError: nothing to undo yet
            except BaseException:
                trace.end(finish_reason="refused")
                raise
        obs = RequestObserver(self.metrics, trace, ctx.adapter, ctx.lane, ref.digest if ref is not None else None)
        generated: dict[int, int] = {}  # per choice (n > 1): every choice's tokens are metered
        stream = self._engine_stream(ctx, req, ref, trace)
        tally = PromptTally(list(map(len, req.prompts)), req.sampling.n)
        try:
            async with aclosing(stream):
                # Each await carries the request's span: a remote engine's worker continues its trace.
                while (out := await trace.carried(anext(stream, None))) is not None:
                    if self.hooks is not None and (pending := self.hooks.progress(ctx, out)) is not None:
                        await pending
                    if not out.new_token_ids and not out.finished:
                        continue  # prefill progress: no token yet
                    tally.add(out)
                    ctx.num_cached_tokens, ctx.num_prompt_tokens = tally.cached_tokens, tally.prompt_tokens
                    if obs.output(out):
                        ctx.first_token_at = time.time()
                    generated[out.index] = out.num_output_tokens
                    ctx.num_output_tokens = sum(generated.values())
                    if out.finished:
                        ctx.finish_reason = out.finish_reason
                    yield out
        except StreamStalledError:
            ctx.finish_reason = "abort"  # the client stopped reading: billed for what it was sent
            raise
        except Exception:
            ctx.finish_reason = ctx.finish_reason or "error"
            raise
        finally:
            ctx.finish_reason = ctx.finish_reason or "abort"  # cancelled or closed early
            ctx.finished_at = time.time()
            if len(req.prompts) > 1:  # some prompts may not have run at all
                ctx.num_prompt_tokens = tally.billed_prompt_tokens(ctx.num_processed_prompt_tokens)
            obs.finish(ctx.finish_reason, ctx.num_output_tokens)
            if self.hooks is not None:
                with trace.span("metering"):
                    await self.hooks.finish(ctx)
            trace.end(finish_reason=ctx.finish_reason, prompt_tokens=ctx.num_prompt_tokens,
                      output_tokens=ctx.num_output_tokens)

    def _engine_stream(self, ctx: RequestContext, req: GenRequest, ref: AdapterRef | None,
                       trace) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for the request: one engine request per prompt, merged."""
        p = ctx.principal
        kwargs = dict(lane=ctx.lane, adapter=ref or ctx.adapter, cache_salt=f"tenant-{p.tenant_id}",
                      tenant=str(p.tenant_id), tenant_weight=p.weight,
                      timeout=p.request_timeout or self.settings.request_timeout)
        if len(req.prompts) == 1:
            return self.engine.generate(req.prompt, req.sampling, request_id=ctx.request_id, **kwargs)
        streams = [self.engine.generate(prompt, req.sampling, request_id=f"{ctx.request_id}-{i}", **kwargs)
                   for i, prompt in enumerate(req.prompts)]
        return merge_prompt_streams(streams, req.sampling.n, ctx.request_id, trace.carried)



def _mixture_of(refs: list[tuple[AdapterRef | None, float]]) -> AdapterRef | None:
    """The mixture of these component versions; None where the engine serves no adapters
    (it refuses the request itself)."""
    if any(ref is None for ref, _ in refs):
        return None
    return mixture_ref(refs)
