"""vLLM's tokenizer endpoints, which its benchmark client and evaluation harnesses probe to
count tokens as the server does: `POST /tokenize` and `POST /detokenize` (also under
/adapters/{adapter}/, where the adapter is implied).

They take a tenant's API key and resolve `model` as the OpenAI routes do (an adapter the
tenant may not use is the same 404 as an unknown one), and every adapter shares the base
model's tokenizer. A chat is rendered exactly as /v1/chat/completions renders it (tools
included), so `count` is the `prompt_tokens` a completion of it reports.

- tokenize: `{"prompt": str, "add_special_tokens": true, "return_token_strs": false}` or
  `{"messages": [...], "add_generation_prompt": true, "add_special_tokens": false,
  "return_token_strs": false, "tools": [...]}` -> `{"count", "max_model_len", "tokens",
  "token_strs"}`.
- detokenize: `{"tokens": [int, ...]}` -> `{"prompt": str}`.
- `GET /tokenizer_info`: the tokenizer's class, special tokens and chat template.

The body, its JSON and the text are bounded as for a completion (request_limits.py), and
tokenizing runs on the parse pool, never on the event loop.
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplex.platform.errors import BadRequestError
from loraplex.platform.serving.gateway import Gateway
from loraplex.platform.http import json_response
from loraplex.platform.serving.openai_routes import api_endpoint
from loraplex.platform.serving.protocol import chat_prompt, get_bool
from loraplex.platform.serving.request_limits import (
    check_content_length,
    parse_json_object,
    parse_request_json,
    read_charged_body,
)
from loraplex.platform.tenancy.throttle import client_address

_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                          "add_special_tokens", "return_token_strs", "tools", "tool_choice", "parallel_tool_calls"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_REFUSED_HINTS = {"chat_template": "the model's own chat template is used",
                  "chat_template_kwargs": "the model's own chat template is used",
                  "mm_processor_kwargs": "this model takes text only"}


async def _authorized_body(request: Request, gw: Gateway, prompt: bool) -> dict:
    """The caller's key checked, its body read within the limits (with the bounds on a
    prompt's shape and text when it carries one), and `model` resolved."""
    limits = gw.settings.limits
    check_content_length(request, limits.max_body_bytes)
    principal = await gw.auth.authenticate(request.headers.get("authorization"), client_address(request))
    raw = await read_charged_body(request, principal.tenant, gw.body_budget, limits.max_body_bytes)
    pool = request.app.state.parse_pool
    if prompt:
        body = await pool.parse(raw, parse_request_json, limits, None, gw.max_model_len, gw.tokenizer.max_token_chars)
    else:
        body = await pool.parse(raw, parse_json_object, limits)
    gw.resolve_model(principal, body.get("model"), request.path_params.get("adapter"))  # 404 unless allowed
    return body


def _check_fields(body: dict, known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            hint = _REFUSED_HINTS.get(name)
            raise BadRequestError(f"{name} is not supported" + (f": {hint}" if hint else " (unknown field)"), name)


def tokenize_body(body: dict, tokenizer, max_model_len: int) -> dict[str, Any]:
    """The answer to a tokenize request (runs on the parse pool)."""
    strs = get_bool(body, "return_token_strs", False)
    if "messages" in body:
        _check_fields(body, _CHAT_FIELDS)
        if get_bool(body, "continue_final_message", False):
            raise BadRequestError("continue_final_message is not supported", "continue_final_message")
        if get_bool(body, "add_special_tokens", False):
            raise BadRequestError("add_special_tokens must be false with messages: the chat template writes the "
                                  "special tokens", "add_special_tokens")
        ids, _ = chat_prompt(body, tokenizer, get_bool(body, "add_generation_prompt", True))
    else:
        _check_fields(body, _PROMPT_FIELDS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequestError("prompt must be a string (or send messages)", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=get_bool(body, "add_special_tokens", True))
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.ids_to_tokens(ids, skip_special_tokens=False) if strs else None}


def detokenize_body(body: dict, tokenizer, max_model_len: int) -> dict[str, Any]:
    """The answer to a detokenize request: the text of at most `max_model_len` known token ids."""
    _check_fields(body, _DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequestError("tokens must be a list of token ids", "tokens")
    if len(ids) > max_model_len:
        raise BadRequestError(f"tokens: at most {max_model_len} token ids (the model's context)", "tokens")
    if any(not 0 <= t < tokenizer.vocab_size for t in ids):
        raise BadRequestError(f"tokens: token ids must be between 0 and {tokenizer.vocab_size - 1}", "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@api_endpoint("tokenize")
async def tokenize(request: Request, gw: Gateway) -> Response:
    body = await _authorized_body(request, gw, prompt=True)
    return json_response(await request.app.state.parse_pool.run(tokenize_body, body, gw.tokenizer, gw.max_model_len))


@api_endpoint("detokenize")
async def detokenize(request: Request, gw: Gateway) -> Response:
    body = await _authorized_body(request, gw, prompt=False)
    return json_response(await request.app.state.parse_pool.run(detokenize_body, body, gw.tokenizer,
                                                                 gw.max_model_len))


def tokenizer_info_of(tokenizer, max_model_len: int) -> dict[str, Any]:
    """What vLLM's /tokenizer_info tells (lm-evaluation-harness's remote tokenizer reads
    it): the tokenizer's class, special tokens and chat template."""
    hf = tokenizer.hf
    info: dict[str, Any] = {"tokenizer_class": type(hf).__name__, "model_max_length": max_model_len,
                            "chat_template": tokenizer.chat_template}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = getattr(hf, name, None)
        info[name] = value if isinstance(value, str) else None
    return info


@api_endpoint("tokenize")
async def tokenizer_info(request: Request, gw: Gateway) -> Response:
    principal = await gw.auth.authenticate(request.headers.get("authorization"), client_address(request))
    gw.resolve_model(principal, None, request.path_params.get("adapter"))  # 404 unless allowed
    return json_response(tokenizer_info_of(gw.tokenizer, gw.max_model_len))


def tokenize_routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"])]
