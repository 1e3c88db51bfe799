"""Which OpenAI request fields are honoured, which are ignored and why, and the parsing
of the ones beyond plain sampling: `response_format`, `n`/`best_of`, penalties and
biases, `echo`/`suffix`.

Every field of a request body is either honoured, in the short list of harmless fields
ignored below, or refused with a 400 naming it: a client never gets an answer that
silently skipped something it asked for.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import MAX_N
from loraplex.engine.structured import StructuredOutput

from loraplex.platform.errors import BadRequestError

_SAMPLING = {"model", "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", "n", "seed", "stop",
             "stream", "stream_options", "temperature", "top_p", "response_format",
             # extensions (vLLM's names)
             "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "priority",
             # loraplex's: an adapter mixture (gateway.resolve_model)
             "adapters"}
CHAT_FIELDS = _SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                           "parallel_tool_calls"}
COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo", "best_of", "suffix"}
# Accepted and ignored: they describe the caller or ask for bookkeeping that changes
# nothing in the answer (end-user ids, tags, OpenAI-side storage, a cache-routing hint
# where the prefix cache needs none).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key", "service_tier"})
# OpenAI fields with a hint on what to send instead.
_REFUSED_HINTS = {
    "functions": "use tools", "function_call": "use tool_choice",
    "audio": "this model produces text only", "modalities": "this model produces text only",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "this model does not reason",
    "verbosity": "not supported", "web_search_options": "web search is not supported",
}
_SERVICE_TIERS = (None, "auto", "default")


def check_fields(body: dict, chat: bool) -> None:
    """A 400 naming the first field that is neither honoured nor harmlessly ignored."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name in known or name in IGNORED_FIELDS:
            continue
        hint = _REFUSED_HINTS.get(name)
        if name == "modalities" and body[name] in (None, ["text"]):
            continue
        raise BadRequestError(f"{name} is not supported" + (f": {hint}" if hint else " (unknown field)"), name)
    if body.get("service_tier") not in _SERVICE_TIERS:
        raise BadRequestError("service_tier must be 'auto' or 'default'", "service_tier")


def response_format(body: dict) -> StructuredOutput | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind != "json_schema":
        raise BadRequestError("response_format.type must be text, json_object or json_schema", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, Mapping):
        raise BadRequestError("response_format.json_schema must be an object with name and schema",
                              "response_format")
    name, strict = spec.get("name"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise BadRequestError("response_format.json_schema.name must be a non-empty string", "response_format")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequestError("response_format.json_schema.strict must be a boolean", "response_format")
    schema = spec.get("schema", {"type": "object"})
    try:
        return StructuredOutput.json_schema(schema, bool(strict))
    except InvalidRequestError as exc:  # UnsupportedSchemaError names the features
        raise BadRequestError(f"response_format: {exc}", "response_format") from None


def choices(body: dict, chat: bool) -> tuple[int, int]:
    """(choices returned, choices generated): `best_of` generates more and keeps the `n`
    with the highest cumulative logprob (completions only, not streamed)."""
    n = _count(body, "n", 1)
    best_of = n if chat else _count(body, "best_of", n)
    if best_of < n:
        raise BadRequestError("best_of must be at least n", "best_of")
    if best_of > n and body.get("stream"):
        raise BadRequestError("best_of cannot be used with stream", "best_of")
    return n, best_of


def _count(body: dict, name: str, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N:
        raise BadRequestError(f"{name} must be an integer between 1 and {MAX_N}", name)
    return v


def logit_processors(body: dict) -> dict[str, Any]:
    """SamplingParams keyword arguments for penalties, logit_bias and min_p; the range
    checks are SamplingParams' own (see `sampling_error`)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequestError(f"{name} must be a number", name)
        out[name] = float(v)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise BadRequestError("logit_bias must map token ids to numbers", "logit_bias")
        out["logit_bias"] = bias
    return out


def sampling_error(exc: InvalidRequestError, body: dict) -> BadRequestError:
    """SamplingParams' message starts with the field it is about: that is the param."""
    word = str(exc).split(" ", 1)[0]
    return BadRequestError(str(exc), word if word in body else None)


def echo_and_suffix(body: dict) -> bool:
    """Completions' `echo`; a `suffix` (fill-in-the-middle) is refused: no infill here."""
    if body.get("suffix") not in (None, ""):
        raise BadRequestError("suffix is not supported: this model has no fill-in-the-middle mode", "suffix")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequestError("echo must be a boolean", "echo")
    return bool(echo)
