"""Bounds on what one OpenAI request may make the gateway do before admission.

- The body: refused with 413 from its Content-Length alone, or as soon as the bytes read
  pass `ServerLimits.max_body_bytes` (the rest is never read; the connection closes).
- Its JSON: nesting depth, number of messages and of content parts, each a 400 naming
  the field.
- The prompt (with a chat's tool definitions, which the template renders into it): text
  whose length in characters cannot fit `max_model_len` tokens (each
  token spells at most `Tokenizer.max_token_chars` characters, with a margin for
  normalizers that merge characters) is refused with 413 before it is tokenized.
- Parsing the JSON, checking it, tokenizing and the chat template run on a small pool of
  threads of their own, a big body in a process of its own first (parse_pool.py).
- The bytes: each tenant may send `ServerLimits.body_bytes_per_second` of request body
  (`BodyBudget`, a token bucket holding one largest body). Parsing JSON holds the
  interpreter lock whichever thread does it (orjson does not release it), so bytes are
  what a tenant's requests cost everyone else before they are admitted: past its budget
  a request gets 429 from its Content-Length, before its body is read.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from starlette.requests import ClientDisconnect, Request

from loraplex.engine.errors import PromptTooLongError

from loraplex.platform.errors import BadRequestError, PayloadTooLargeError, RateLimitedError
from loraplex.platform.settings import ServerLimits
from loraplex.platform.tenancy.throttle import TokenBuckets

# Characters a normalizer may fold into one (e.g. NFC composing a letter and its accents).
_NORMALIZER_MARGIN = 4


def check_content_length(request: Request, max_bytes: int) -> None:
    """413 for a declared body over `max_bytes`, before reading any of it."""
    length = request.headers.get("content-length")
    if length is None:
        return
    if not (length.isascii() and length.isdigit()) or len(length) > 18:
        raise BadRequestError("the Content-Length header is not a number")
    if int(length) > max_bytes:
        raise PayloadTooLargeError(f"the request body is {int(length)} bytes, over the {max_bytes} byte limit")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or 413 once more than `max_bytes` arrived (chunked bodies too)."""
    check_content_length(request, max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLargeError(f"the request body is over the {max_bytes} byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequestError("the client went away before sending the whole body") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes, limits: ServerLimits) -> dict:
    """A JSON object within the nesting bound, or 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    if json_depth(raw) > limits.max_json_depth:
        raise BadRequestError(f"the request body nests deeper than {limits.max_json_depth} levels")
    return body


_QUOTE, _BACKSLASH, _U, _COLON = ord('"'), ord("\\"), ord("u"), ord(":")
# The bytes that decide nesting: quotes (strings hide brackets) and brackets.
_MARKS = np.zeros(256, dtype=bool)
_MARKS[[_QUOTE, ord("["), ord("{"), ord("]"), ord("}")]] = True
# +1 for an opening bracket, -1 for a closing one.
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in `raw`, valid JSON (orjson parsed it). Counted
    over the bytes in a few vectorized passes, not by walking the parsed value in Python:
    a body of many small values would otherwise hold the interpreter lock for a tenth of a
    second or more per MiB."""
    # Every backslash in valid JSON starts an escape, so pairing them from the left finds
    # the escaped backslashes; a backslash left before a quote then escapes it.
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = np.frombuffer(plain, dtype=np.uint8)
    marks = data[_MARKS[data]]
    outside = (np.cumsum(marks == _QUOTE, dtype=np.int32) & 1) == 0  # an opening quote counts as inside
    return int(np.cumsum(_STEP[marks[outside]], dtype=np.int32).max(initial=0))


def check_chat_shape(body: dict, limits: ServerLimits) -> None:
    """Bounds on `messages` and their content parts."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return  # the parser names what is wrong with it
    if len(messages) > limits.max_messages:
        raise BadRequestError(f"messages: at most {limits.max_messages} messages, got {len(messages)}", "messages")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and len(content) > limits.max_content_parts:
            raise BadRequestError(f"messages[{i}].content: at most {limits.max_content_parts} parts, "
                                  f"got {len(content)}", f"messages[{i}].content")


def _text_chars(value: Any, keys: bool = False) -> int:
    """Characters of text in a prompt or in messages (strings anywhere inside; with
    `keys`, object keys too: tool definitions are rendered into the prompt whole).
    Counted over orjson's bytes in a few vectorized passes rather than by walking the
    value in Python, which held the interpreter lock ~60 ms for 3.5 MiB of tools."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (dict, list)):
        return 0
    # orjson escapes only quotes, backslashes and control characters; each escape is one
    # character. Escaped quotes and backslashes become one byte here, so the quotes left
    # delimit strings and every backslash left starts a \n-like or \u00XX escape.
    plain = orjson.dumps(value).replace(b"\\\\", b"\x01").replace(b'\\"', b"\x01")
    data = np.frombuffer(plain, dtype=np.uint8)
    quotes = np.flatnonzero(data == _QUOTE)
    opens, closes = quotes[0::2], quotes[1::2]
    # Bytes that are no character of their own: UTF-8 continuation bytes, an escape's
    # backslash, the 4 hex digits of a \u00XX (none occurs outside strings).
    extra = np.concatenate([np.flatnonzero((data & 0xC0) == 0x80), np.flatnonzero(data == _BACKSLASH)])
    u_escapes = np.flatnonzero((data[:-1] == _BACKSLASH) & (data[1:] == _U))
    if keys:
        return int((closes - opens - 1).sum()) - extra.size - 4 * u_escapes.size
    # A key's closing quote is followed by a colon (orjson writes no spaces).
    value_string = data[closes + 1] != _COLON
    in_value = value_string[np.searchsorted(opens, extra, side="right") - 1]
    u_in_value = value_string[np.searchsorted(opens, u_escapes, side="right") - 1]
    return int((closes - opens - 1)[value_string].sum()) - int(in_value.sum()) - 4 * int(u_in_value.sum())


def check_prompt_chars(body: dict, chat: bool, max_model_len: int, max_token_chars: int) -> None:
    """413 for text that cannot fit the context whatever it tokenizes to: each prompt of a
    completion's list on its own, or a chat's messages with the tool definitions the
    template renders with them."""
    bound = max_model_len * max(1, max_token_chars) * _NORMALIZER_MARGIN
    if chat:
        chars = _text_chars(body.get("messages")) + _text_chars(body.get("tools"), keys=True)
        if chars > bound:
            what = "prompt with its tool definitions" if body.get("tools") else "prompt"
            raise PromptTooLongError(f"the {what} has {chars} characters: more than this model's context of "
                                     f"{max_model_len} tokens can hold")
        return
    text = body.get("prompt")
    several = isinstance(text, list) and any(isinstance(p, (str, list)) for p in text)
    for i, prompt in enumerate(text if several else [text]):
        chars = _text_chars(prompt)
        if chars > bound:
            which = f"prompt {i}" if several else "the prompt"
            raise PromptTooLongError(f"{which} has {chars} characters: more than this model's context of "
                                     f"{max_model_len} tokens can hold")


def check_prompt_count(body: dict, limits: ServerLimits) -> None:
    """A completion's list of prompts is at most `max_prompts` long (checked before any
    is tokenized)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > limits.max_prompts:
        raise BadRequestError(f"prompt: at most {limits.max_prompts} prompts per request, got {len(prompt)}",
                              "prompt")


def check_choices(num_sequences: int, limits: ServerLimits) -> None:
    """Prompts x n (or best_of) is at most `max_choices`."""
    if num_sequences > limits.max_choices:
        raise BadRequestError(f"n: prompts x n (or best_of) is {num_sequences}, over the cap of "
                              f"{limits.max_choices} sequences per request", "n")


def parse_request_json(raw: bytes, limits: ServerLimits, chat: bool | None, max_model_len: int,
                       max_token_chars: int) -> dict:
    """An OpenAI request's JSON within every bound that needs no tokenizer (on the parse
    pool): its shape, and its text against the context. `chat` None: a chat if it has
    `messages` (/tokenize takes either)."""
    body = parse_json_object(raw, limits)
    chat = "messages" in body if chat is None else chat
    if chat:
        check_chat_shape(body, limits)
    else:
        check_prompt_count(body, limits)
    check_prompt_chars(body, chat, max_model_len, max_token_chars)
    return body


class BodyBudget:
    """Bytes of request body each tenant may send per second: a token bucket per tenant
    holding at most `burst` bytes (at least one largest body, so any body that fits the
    size limit gets in once the bucket has refilled)."""

    def __init__(self, rate: int, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_tenants: int = 65_536) -> None:
        self.rate, self.burst = rate, max(burst, rate)
        self._buckets = TokenBuckets(self.burst, rate, max_tenants, clock)

    def admit(self, tenant: str, declared: int) -> None:
        """Charge a body of `declared` bytes before it is read, or 429 with the seconds
        until the bucket holds it."""
        left = self._buckets.level(tenant)
        if declared > left:
            raise RateLimitedError(f"this tenant's request bodies are over {self.rate} bytes per second; "
                                   f"retry later", retry_after=max(1.0, (declared - left) / self.rate))
        self._buckets.take(tenant, declared)

    def debit(self, tenant: str, size: int) -> None:
        """Charge a body already read (one sent without a Content-Length): the bucket may
        go below zero, and the tenant's next bodies wait for it."""
        self._buckets.take(tenant, size, floor=None)


async def read_charged_body(request: Request, tenant: str, budget: BodyBudget, max_bytes: int) -> bytes:
    """The body within its size limit, charged to `tenant`'s budget (before it is read when
    its length is declared)."""
    check_content_length(request, max_bytes)
    declared = request.headers.get("content-length")
    if declared is not None:
        budget.admit(tenant, int(declared))
    raw = await read_body(request, max_bytes)
    if declared is None:
        budget.debit(tenant, len(raw))
    return raw
