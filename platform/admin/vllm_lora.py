"""vLLM's runtime LoRA endpoints, which llm-d's adapter sidecar, AIBrix and KServe call on
vLLM pods: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter` `{"lora_name"}`.

They take the admin token (never a tenant key) and do what the admin API does: the
folder at `lora_path` (on this server) is validated by the adapter store, published to
the registry and the shared adapter store (so every replica and worker serves it), and
the change is audited. A loaded adapter is public, as on vLLM, where any client may name
it; `"public": false` keeps it for the tenants the admin API grants it to. Loading a name
that exists is refused as vLLM refuses it, unless `load_inplace` is true (a new version).
Answers are vLLM's: 200 with a plain-text line; errors in the OpenAI error body.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from loraplex.adapters.store import validate_name

from loraplex.platform.admin.auth import Admin
from loraplex.platform.admin.state import AdminState, log
from loraplex.platform.errors import BadRequestError, ConflictError, NotFoundError, api_error, error_response
from loraplex.platform.serving.request_limits import check_content_length, parse_json_object, read_body
from loraplex.platform.tenancy.adapter_registry import adapter_info, add_adapter, remove_adapter
from loraplex.platform.tenancy.throttle import client_address

_LOAD_FIELDS = frozenset({"lora_name", "lora_path", "load_inplace", "public"})
_UNLOAD_FIELDS = frozenset({"lora_name", "lora_int_id"})


async def _admin_body(request: Request, st: AdminState, fields: frozenset[str]) -> tuple[Admin, dict]:
    """The admin token checked (a browser session does not count here: these are machine
    calls, made without CSRF tokens), then the JSON body within the admin limits."""
    limit = st.settings.limits.max_admin_body_bytes
    check_content_length(request, limit)
    admin = await asyncio.to_thread(st.auth.authenticate, request.method, request.headers.get("authorization"),
                                    None, None, client_address(request))
    body = parse_json_object(await read_body(request, limit), st.settings.limits)
    for name in body:
        if name not in fields:
            raise BadRequestError(f"{name} is not supported (unknown field)", name)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequestError("lora_name must be a non-empty string", "lora_name")
    try:
        validate_name(name)
    except Exception as exc:  # noqa: BLE001 - the store's own message says what a name may be
        raise BadRequestError(f"lora_name: {exc}", "lora_name") from None
    return admin, body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise BadRequestError(f"{name} must be a boolean", name)
    return v


async def _load(request: Request, st: AdminState) -> Response:
    admin, body = await _admin_body(request, st, _LOAD_FIELDS)
    name, path = body["lora_name"], body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise BadRequestError("lora_path must be a non-empty string", "lora_path")
    if name == st.settings.model_name:
        raise BadRequestError(f"lora_name: {name!r} is the base model's name", "lora_name")
    replace, public = _flag(body, "load_inplace", False), _flag(body, "public", True)
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise BadRequestError("lora_path must be a folder on this server holding adapter_config.json and "
                              "adapter_model.safetensors", "lora_path")
    try:
        before = await asyncio.to_thread(adapter_info, st.db, name)
    except NotFoundError:
        before = None
    if before is not None and not replace:
        raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    info = await asyncio.to_thread(add_adapter, st.db, st.store, name, folder, public=public, replace=replace,
                                   reserved=(st.settings.model_name,), blobs=st.blobs)
    st.adapters_changed()
    if before is None:
        await st.audit(admin, "adapter.upload", f"adapter:{name}", digest=info.digest, public=info.public,
                       rank=info.rank, size_bytes=info.size_bytes, via="/v1/load_lora_adapter", lora_path=path)
    else:
        await st.audit(admin, "adapter.replace", f"adapter:{name}", previous_digest=before.digest,
                       digest=info.digest, rank=info.rank, size_bytes=info.size_bytes, via="/v1/load_lora_adapter",
                       lora_path=path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _unload(request: Request, st: AdminState) -> Response:
    admin, body = await _admin_body(request, st, _UNLOAD_FIELDS)
    name = body["lora_name"]
    try:
        info = await asyncio.to_thread(remove_adapter, st.db, st.store, name)
    except NotFoundError:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.") from None
    st.adapters_changed()
    await st.audit(admin, "adapter.remove", f"adapter:{name}", digest=info.digest, via="/v1/unload_lora_adapter")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _endpoint(handler):
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, request.app.state.admin)
        except ConflictError as exc:  # a concurrent load of the same name won the race
            return error_response(api_error(BadRequestError(str(exc), "lora_name")))
        except Exception as exc:  # noqa: BLE001 - mapped to a status in one place
            err = api_error(exc)
            if err.status == 500:
                log.exception("unhandled error in %s", request.url.path)
            return error_response(err)

    endpoint.__name__ = handler.__name__.lstrip("_")
    return endpoint


def vllm_lora_routes() -> list[Route]:
    return [Route("/v1/load_lora_adapter", _endpoint(_load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", _endpoint(_unload), methods=["POST"])]
