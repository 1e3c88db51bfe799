"""The OpenAI wire format of answers: whole responses, stream chunks, usage, logprobs,
finish reasons and in-stream errors (error bodies outside a stream: errors.ApiError).

`render_response` builds a non-streamed answer from the collected outputs; `ChunkStream`
turns the engine's deltas into server-sent events. A request's choices (n > 1) arrive
interleaved, each output tagged with its index (prompt-major with several prompts: prompt
p's choice i is p * n + i); usage counts each prompt once.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson

from loraplex.engine.output import RequestOutput
from loraplex.platform.errors import PlatformError, api_error
from loraplex.platform.serving.prompt_batch import PromptTally
from loraplex.platform.serving.protocol import GenRequest
from loraplex.platform.serving.tool_parsers import CallArgs, CallStart, Content, Event, ParsedOutput, ToolParser

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
    """Completions' logprobs; an entry of `lps` may be None (the prompt's first token)."""
    tokens, chosen, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, lps):
        t = text(tid)
        tokens.append(t)
        chosen.append(lp[0] if lp is not None else None)
        tops.append({text(i): v for i, v in lp[1]} if lp is not None else None)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def _join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def finish_reason(out: RequestOutput) -> str:
    if out.finish_reason == "error":
        raise PlatformError("the engine failed this request")
    return FINISH_REASONS.get(out.finish_reason or "stop", "stop")


@dataclass
class Choice:
    """One choice's outputs, joined."""

    token_ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.parts.append(out.new_text)
        self.logprobs += out.logprobs
        self.last = out

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp[0] for lp in self.logprobs)


class Collected:
    """A whole (non-streamed) answer's outputs, joined per choice (by engine index)."""

    def __init__(self, req: GenRequest) -> None:
        self.choices: dict[int, Choice] = {}
        self.last: RequestOutput | None = None
        self.prompt_logprobs: dict[int, list] = {}  # per prompt
        self.tally = PromptTally(list(map(len, req.prompts)), req.sampling.n)
        self._per_prompt = req.sampling.n

    def add(self, out: RequestOutput) -> None:
        self.tally.add(out)
        self.choices.setdefault(out.index, Choice()).add(out)
        if out.prompt_logprobs:
            self.prompt_logprobs[out.index // self._per_prompt] = out.prompt_logprobs
        self.last = out

    def usage(self) -> dict:
        """Each prompt once; every generated token (best_of's discarded choices too)."""
        completion = sum(c.last.num_output_tokens for c in self.choices.values() if c.last is not None)
        return usage(self.tally.prompt_tokens, completion, self.tally.cached_tokens)


def _picked(req: GenRequest, got: Collected) -> list[tuple[int, Choice]]:
    """(prompt, choice) in answer order: prompt-major; with best_of, each prompt's n most
    likely choices, most likely first."""
    k, picked = req.sampling.n, []
    for p in range(len(req.prompts)):
        group = [got.choices[i] for i in range(p * k, (p + 1) * k) if i in got.choices]
        if req.best_of:
            group = sorted(group, key=lambda c: c.cumulative_logprob, reverse=True)[:req.n]
        picked += [(p, c) for c in group]
    return picked


def render_response(req: GenRequest, head: dict, got: Collected, text: TokenText) -> dict:
    """The body of a non-streamed answer; `head` holds its id, created and model."""
    assert got.last is not None
    if req.chat:
        choices = [_chat_choice(req, i, c, text) for i, (_, c) in enumerate(_picked(req, got))]
    else:
        choices = [_completion_choice(req, i, p, c, got, text) for i, (p, c) in enumerate(_picked(req, got))]
    return {**head, "object": "chat.completion" if req.chat else "text_completion", "choices": choices,
            "usage": got.usage()}


def _chat_choice(req: GenRequest, index: int, c: Choice, text: TokenText) -> dict:
    reason = finish_reason(c.last)
    message: dict = {"role": "assistant", "content": "".join(c.parts)}
    parser = req.tools.new_parser() if req.tools is not None else None
    if parser is not None:
        parsed = ParsedOutput()
        parsed.add(parser.feed(message["content"]))
        parsed.add(parser.finish())
        if parsed.calls:
            message = {"role": "assistant", "content": parsed.content or None,
                       "tool_calls": [call.as_openai() for call in parsed.calls]}
            reason = "tool_calls" if reason == "stop" else reason
    logprobs = chat_logprobs(c.token_ids, c.logprobs, text) if req.logprobs is not None else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _completion_choice(req: GenRequest, index: int, p: int, c: Choice, got: Collected, text: TokenText) -> dict:
    reason = finish_reason(c.last)
    content = "".join(c.parts)
    echo = req.echo[p] if req.echo is not None else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(c.token_ids, c.logprobs, text, len(echo))
        if req.echo is not None and p in got.prompt_logprobs:
            logprobs = _join_logprobs(completion_logprobs(req.prompts[p], got.prompt_logprobs[p], text), logprobs)
    return {"index": index, "text": echo + content, "logprobs": logprobs, "finish_reason": reason}


def _tool_call_deltas(events: list[Event]) -> tuple[str, list[dict]]:
    """Content text and OpenAI `tool_calls` delta entries: a call's id, type and name
    first, then fragments of its arguments."""
    content, calls = "", []
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallStart):
            calls.append({"index": e.index, "id": e.id, "type": "function",
                          "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArgs) and e.text:
            calls.append({"index": e.index, "function": {"arguments": e.text}})
    return content, calls


@dataclass
class _StreamedChoice:
    offset: int = 0  # characters of text sent (completion logprobs' text_offset)
    started: bool = False
    echoed: bool = False
    parser: ToolParser | None = None
    num_output_tokens: int = 0


class ChunkStream:
    """One streamed answer's server-sent events, from the engine's deltas."""

    def __init__(self, req: GenRequest, head: dict, text: TokenText) -> None:
        self.req = req
        self.head = {**head, "object": "chat.completion.chunk" if req.chat else "text_completion"}
        self.text = text
        self.choices = [_StreamedChoice(parser=req.tools.new_parser() if req.tools is not None else None)
                        for _ in range(req.num_sequences)]
        self.prompt_logprobs: dict[int, list] = {}  # per prompt
        self.tally = PromptTally(list(map(len, req.prompts)), req.sampling.n)

    def frame(self, choices: list, use: dict | None = None) -> bytes:
        chunk = {**self.head, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = use
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def opening(self) -> bytes | None:
        """A chat stream starts with the assistant role, for every choice."""
        if not self.req.chat:
            return None
        return self.frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(self.choices))])

    def event(self, out: RequestOutput) -> bytes | None:
        req, state = self.req, self.choices[out.index]
        state.started = True
        self.tally.add(out)
        state.num_output_tokens = out.num_output_tokens
        if out.prompt_logprobs:
            self.prompt_logprobs[req.prompt_number(out.index)] = out.prompt_logprobs
        reason = finish_reason(out) if out.finish_reason is not None or out.finished else None
        choice: dict = {"index": out.index, "logprobs": None, "finish_reason": reason}
        if req.chat:
            delta = self._chat_delta(state, out, reason)
            if not delta and reason is None and req.logprobs is None:
                return None  # nothing to say yet (a character or a possible call still incomplete)
            choice["delta"] = delta
            if state.parser is not None and state.parser.num_calls and reason == "stop":
                choice["finish_reason"] = "tool_calls"
            if req.logprobs is not None:
                choice["logprobs"] = chat_logprobs(out.new_token_ids, out.logprobs, self.text)
            return self.frame([choice])
        return self._completion_event(state, out, choice)

    def _chat_delta(self, state: _StreamedChoice, out: RequestOutput, reason: str | None) -> dict:
        if state.parser is None:
            return {"content": out.new_text} if out.new_text or reason is None else {}
        events = state.parser.feed(out.new_text)
        if reason is not None:
            events += state.parser.finish()
        content, calls = _tool_call_deltas(events)
        delta: dict = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _completion_event(self, state: _StreamedChoice, out: RequestOutput, choice: dict) -> bytes | None:
        req = self.req
        text = out.new_text
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(out.new_token_ids, out.logprobs, self.text, state.offset)
        if req.echo is not None and not state.echoed:
            # The prompt goes first, in the choice's first chunk.
            state.echoed = True
            p = req.prompt_number(out.index)
            text = req.echo[p] + text
            if logprobs is not None and p in self.prompt_logprobs:
                logprobs = _join_logprobs(completion_logprobs(req.prompts[p], self.prompt_logprobs[p], self.text),
                                          completion_logprobs(out.new_token_ids, out.logprobs, self.text,
                                                              len(req.echo[p])))
        if not text and choice["finish_reason"] is None and req.logprobs is None:
            return None
        state.offset += len(text)
        choice["text"] = text
        choice["logprobs"] = logprobs
        return self.frame([choice])

    def closing(self, last: RequestOutput) -> bytes | None:
        """The usage chunk, when the client asked for it: each prompt once."""
        if not self.req.include_usage:
            return None
        completion = sum(c.num_output_tokens for c in self.choices)
        return self.frame([], usage(self.tally.prompt_tokens, completion, self.tally.cached_tokens))

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
