"""The OpenAI wire format of answers: whole responses, stream chunks, usage, logprobs,
finish reasons and in-stream errors (error bodies outside a stream: errors.ApiError).

`render_response` builds a non-streamed answer from the collected outputs; `ChunkStream`
turns the engine's deltas into server-sent events.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from loraplex.engine.engine import RequestOutput
from loraplex.platform.errors import PlatformError, api_error
from loraplex.platform.serving.protocol import GenRequest

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
# A request the server's deadline cut short reads as "length": the output is incomplete.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop", "timeout": "length"}


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """Token id -> text for logprobs, memoized (the vocabulary is finite)."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._memo.get(token_id)
        if s is None:
            s = self._memo[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


def chat_logprobs(token_ids: list[int], lps: list, text: TokenText) -> dict:
    content = []
    for tid, (chosen, top) in zip(token_ids, lps):
        t = text(tid)
        content.append({"token": t, "logprob": chosen, "bytes": list(t.encode()),
                        "top_logprobs": [{"token": text(i), "logprob": lp, "bytes": list(text(i).encode())}
                                         for i, lp in top]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], lps: list, text: TokenText, offset: int = 0) -> dict:
    tokens, chosen, tops, offsets = [], [], [], []
    for tid, (lp, top) in zip(token_ids, lps):
        t = text(tid)
        tokens.append(t)
        chosen.append(lp)
        tops.append({text(i): v for i, v in top})
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def finish_reason(out: RequestOutput) -> str:
    if out.finish_reason == "error":
        raise PlatformError("the engine failed this request")
    return FINISH_REASONS.get(out.finish_reason or "stop", "stop")


@dataclass
class Collected:
    """A whole (non-streamed) answer's outputs, joined."""

    token_ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.parts.append(out.new_text)
        self.logprobs += out.logprobs
        self.last = out


def render_response(req: GenRequest, head: dict, got: Collected, text: TokenText) -> dict:
    """The body of a non-streamed answer; `head` holds its id, created and model."""
    last = got.last
    assert last is not None
    use = usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    reason = finish_reason(last)
    content = "".join(got.parts)
    if req.chat:
        logprobs = chat_logprobs(got.token_ids, got.logprobs, text) if req.logprobs is not None else None
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
                  "finish_reason": reason}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": use}
    logprobs = completion_logprobs(got.token_ids, got.logprobs, text) if req.logprobs is not None else None
    choice = {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": reason}
    return {**head, "object": "text_completion", "choices": [choice], "usage": use}


class ChunkStream:
    """One streamed answer's server-sent events, from the engine's deltas."""

    def __init__(self, req: GenRequest, head: dict, text: TokenText) -> None:
        self.req = req
        self.head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}
        self.text = text
        self.offset = 0  # characters of text sent (completion logprobs' text_offset)

    def frame(self, choices: list, use: dict | None = None) -> bytes:
        chunk = {**self.head, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = use
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def opening(self) -> bytes | None:
        """A chat stream starts with the assistant role."""
        if not self.req.chat:
            return None
        return self.frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def event(self, out: RequestOutput) -> bytes | None:
        req = self.req
        reason = finish_reason(out) if out.finished else None
        if not out.new_text and reason is None and req.logprobs is None:
            return None  # nothing to say yet (a character still incomplete)
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": reason}
        if req.logprobs is not None:
            choice["logprobs"] = (chat_logprobs(out.new_token_ids, out.logprobs, self.text) if req.chat else
                                  completion_logprobs(out.new_token_ids, out.logprobs, self.text, self.offset))
        if req.chat:
            choice["delta"] = {"content": out.new_text} if out.new_text or reason is None else {}
        else:
            choice["text"] = out.new_text
            self.offset += len(out.new_text)
        return self.frame([choice])

    def closing(self, last: RequestOutput) -> bytes | None:
        """The usage chunk, when the client asked for it."""
        if not self.req.include_usage:
            return None
        return self.frame([], usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens))

    async def events(self, first: RequestOutput, stream: AsyncIterator[RequestOutput],
                     request_id: str) -> AsyncIterator[bytes]:
        last = first
        try:
            for data in (self.opening(), self.event(first)):
                if data is not None:
                    yield data
            async for out in stream:
                last = out
                if (data := self.event(out)) is not None:
                    yield data
            if (data := self.closing(last)) is not None:
                yield data
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            err = api_error(exc)
            if err.status == 500:
                log.exception("error while streaming %s", request_id)
            yield b"data: " + orjson.dumps(err.body()) + b"\n\n"
        finally:
            await stream.aclose()
        yield DONE
