"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

The same routes are mounted under /adapters/{adapter}/v1, where the adapter is implied
and the body's `model` field is ignored, so an unmodified OpenAI client whose base URL
points there needs no model name.

`model` names the base model (its served name; omitted or "" also means the base) or an
adapter the tenant may use. Unknown adapters and adapters of other tenants get the same
404, so their existence does not leak.

Lanes: a request runs in its tenant's lane. It may ask for a lower one with the
`x-loraplex-lane` header or the `priority` field (interactive|standard|batch, or 0|1|2,
0 highest); asking for a higher lane, or one the tenant is not allowed, is a 403
(permission_error) rather than a silent cap, so a client learns its request did not get
what it asked for. If both are given, the lower of the two applies.

Which fields are honoured, ignored or refused: serving/openai_fields.py (and the README's
"OpenAI parameters" section); tools: serving/tools.py.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplex.engine.output import RequestOutput

from loraplex.platform.errors import api_error, error_response, mapping_of
from loraplex.platform.http import ClientDisconnected, json_response, until_disconnected
from loraplex.platform.serving.gaie import OBJECTIVE_HEADER
from loraplex.platform.serving.gateway import LANE_HEADER, Call, Gateway
from loraplex.platform.serving.protocol import GenRequest
from loraplex.platform.serving.auth import Principal
from loraplex.platform.serving.request_limits import check_content_length, read_charged_body
from loraplex.platform.serving.streaming import SSEResponse
from loraplex.platform.serving.render import ChunkStream, Collected, render_response
from loraplex.platform.tenancy.throttle import client_address

log = logging.getLogger(__name__)
_CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics only


def api_endpoint(endpoint: str) -> Callable:
    """Wraps a handler: a domain error goes to the app's exception handlers (which count
    it under `endpoint`); an unexpected one becomes a 500 here."""

    def deco(fn: Callable[[Request, Gateway], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            gw: Gateway = request.app.state.gateway
            request.state.api_endpoint = endpoint
            try:
                resp = await fn(request, gw)
            except ClientDisconnected:
                gw.metrics.api_request(endpoint, _CLIENT_CLOSED)
                return Response(status_code=_CLIENT_CLOSED)
            except Exception as exc:
                if mapping_of(exc) is not None:
                    raise  # rendered by the app's exception handlers
                log.exception("unhandled error in %s", endpoint)
                resp = error_response(api_error(exc))
            gw.metrics.api_request(endpoint, resp.status_code)
            return resp

        handler.__name__ = fn.__name__
        return handler

    return deco


async def _generate(request: Request, gw: Gateway, chat: bool) -> Response:
    """HTTP around `Gateway.handle` (parse -> admit -> run): the call in, the response out."""
    limits = gw.settings.limits
    check_content_length(request, limits.max_body_bytes)  # 413 before anything is read or looked up

    def read_body(principal: Principal) -> Awaitable[bytes]:
        return read_charged_body(request, principal.tenant, gw.body_budget, limits.max_body_bytes)

    call = Call(chat, request.headers.get("authorization"), client_address(request), read_body,
                request.path_params.get("adapter"), request.headers.get(LANE_HEADER),
                request.headers.get(OBJECTIVE_HEADER))
    ctx, req, stream = await gw.handle(call, request.app.state.parse_pool)
    head = {"id": ctx.request_id, "created": int(ctx.received_at), "model": ctx.model}
    if req.stream:
        first = await until_disconnected(request.receive, anext(stream))
        chunks = ChunkStream(req, head, gw.token_text)
        return SSEResponse(chunks.events(first, stream, ctx.request_id), source=stream)
    got = await until_disconnected(request.receive, _collect(stream, req))
    return json_response(render_response(req, head, got, gw.token_text))


async def _collect(stream: AsyncIterator[RequestOutput], req: GenRequest) -> Collected:
    got = Collected(req)
    async for out in stream:
        got.add(out)
    return got


@api_endpoint("chat")
async def chat_completions(request: Request, gw: Gateway) -> Response:
    return await _generate(request, gw, chat=True)


@api_endpoint("completions")
async def completions(request: Request, gw: Gateway) -> Response:
    return await _generate(request, gw, chat=False)


def _model_card(gw: Gateway, name: str, parent: str | None) -> dict:
    return {"id": name, "object": "model", "created": gw.started_at, "owned_by": "loraplex",
            "root": name, "parent": parent, "max_model_len": gw.max_model_len}


def _visible_models(gw: Gateway, request: Request, principal) -> list[dict]:
    path_adapter = request.path_params.get("adapter")
    if path_adapter is not None:
        gw.resolve_model(principal, None, path_adapter)  # 404 unless allowed
        return [_model_card(gw, path_adapter, gw.model_name)]
    return [_model_card(gw, gw.model_name, None)] + [_model_card(gw, a, gw.model_name)
                                                       for a in sorted(principal.adapters)]


@api_endpoint("models")
async def list_models(request: Request, gw: Gateway) -> Response:
    principal = await gw.auth.authenticate(request.headers.get("authorization"), client_address(request))
    return json_response({"object": "list", "data": _visible_models(gw, request, principal)})


@api_endpoint("models")
async def get_model(request: Request, gw: Gateway) -> Response:
    principal = await gw.auth.authenticate(request.headers.get("authorization"), client_address(request))
    name = request.path_params["model"]
    for card in _visible_models(gw, request, principal):
        if card["id"] == name:
            return json_response(card)
    gw.resolve_model(principal, name, None)  # raises the same 404 as an unknown adapter
    return json_response(_model_card(gw, name, gw.model_name))


def openai_routes() -> list[Route]:
    return [
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/models", list_models, methods=["GET"]),
        Route("/models/{model:path}", get_model, methods=["GET"]),
    ]
