"""The OpenAPI document of the OpenAI-compatible routes the gateway serves, published at
/v1/openapi.json (the admin API has its own, at /admin/api/openapi.json).

It describes what the gateway accepts (OpenAI's fields plus its extensions), the caps of
`ServerLimits`, and that every error is OpenAI's error body.
"""
from __future__ import annotations

from typing import Any

from loraplex.engine.tokenizer import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

from loraplex.platform.settings import ServerLimits

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ERRORS = {"400": "A malformed field: `error.param` names it", "401": "Missing, unknown, revoked or expired API key",
           "403": "A lane above the tenant's", "404": "Unknown model, or one this tenant may not use",
           "413": "Body over its size limit, or a prompt longer than the context",
           "429": "Over a quota, or too many failed authentications from this address (see Retry-After)",
           "503": "Draining, overloaded, or metering or the adapter store unavailable (see Retry-After)"}


def _sampling(limits: ServerLimits) -> dict[str, Any]:
    lane = {"oneOf": [{"type": "string", "enum": ["interactive", "standard", "batch"]},
                      {"type": "integer", "minimum": 0, "maximum": 2}]}
    return {
        "model": {"type": "string", "description": "the base model's id or an adapter's name"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "seed": {"type": "integer"},
        "stop": {"oneOf": [{"type": "string", "maxLength": MAX_STOP_STRING_CHARS},
                           {"type": "array", "maxItems": MAX_STOP_STRINGS,
                            "items": {"type": "string", "maxLength": MAX_STOP_STRING_CHARS}}]},
        "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": {"type": "integer"}},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "ignore_eos": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0},
        "n": {"type": "integer", "minimum": 1},
        "priority": lane,
    }


def _tokenizer_schemas(message: dict, limits: ServerLimits) -> dict[str, Any]:
    model = {"type": "string", "description": "the base model's id or an adapter's name"}
    flag = {"type": "boolean"}
    prompt = {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
        "model": model, "prompt": {"type": "string"}, "add_special_tokens": flag, "return_token_strs": flag}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                                     "items": message},
        "add_generation_prompt": flag, "return_token_strs": flag}}
    return {"TokenizeRequest": {"oneOf": [prompt, chat]},
            "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
                "model": model, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}


def openai_openapi(limits: ServerLimits = ServerLimits()) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"},
                              {"type": "array", "maxItems": limits.max_content_parts, "items": part}]}}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        **_sampling(limits),
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        **_sampling(limits),
        "prompt": {"oneOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts,
                                         "items": {"oneOf": [text, ids]}}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}}
    body_note = f"JSON, at most {limits.max_body_bytes} bytes, nested at most {limits.max_json_depth} deep"

    def op(op_id: str, summary: str, schema: str | None, codes: tuple[str, ...]) -> dict[str, Any]:
        item: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": {
            "200": {"description": "OK (a JSON object, or Server-Sent Events when `stream` is true)",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{c: {"$ref": "#/components/responses/Error"} for c in codes}}}
        if schema:
            item["requestBody"] = {"required": True, "description": body_note, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
        return item

    gen = ("400", "401", "403", "404", "413", "429", "503")
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex OpenAI-compatible API", "version": "1",
                 "description": "OpenAI's chat completions, completions and models, with loraplex's "
                                "extensions (top_k, ignore_eos, min_tokens, stop_token_ids, priority)."},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": op("createChatCompletion", "Chat completion", "ChatRequest", gen)},
            "/v1/completions": {"post": op("createCompletion", "Text completion", "CompletionRequest", gen)},
            "/v1/models": {"get": op("listModels", "The base model and the adapters this key may use", None,
                                     ("401", "429"))},
            "/tokenize": {"post": op("tokenize", "vLLM's tokenize: a prompt's or a chat's token ids",
                                     "TokenizeRequest", ("400", "401", "404", "413", "429"))},
            "/detokenize": {"post": op("detokenize", "vLLM's detokenize: token ids' text", "DetokenizeRequest",
                                       ("400", "401", "404", "413", "429"))},
            "/tokenizer_info": {"get": op("tokenizerInfo", "vLLM's tokenizer_info: special tokens, chat template",
                                          None, ("401", "429"))},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"ChatRequest": chat, "CompletionRequest": completion, "Error": _ERROR,
                        **_tokenizer_schemas(message, limits)},
            "responses": {"Error": {"description": "; ".join(f"{k}: {v}" for k, v in _ERRORS.items()),
                                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
        },
    }
