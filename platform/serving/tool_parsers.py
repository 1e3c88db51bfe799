"""Tool calls out of a model's output text, per model family, incrementally.

A parser is fed the text deltas of one choice and returns what they make certain:
content to show, the start of a call (its id and function name) and fragments of its
arguments. Streaming sends these as OpenAI `tool_calls` deltas; a non-streamed answer
feeds the whole text at once, so both see the same content and calls.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str  # the next fragment of the arguments' JSON text


Event = Content | CallStart | CallArgs


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    """Incremental splitter of one choice's output into content and tool calls.

    `feed(delta)` returns the events the text so far makes certain (it may hold back text
    that could still turn out to start a call); `finish()` returns the rest. Concatenating
    every Content gives the content, every CallArgs of a call its arguments. With
    `parallel` False, calls after the first are dropped.
    """

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.num_calls = 0

    @abstractmethod
    def feed(self, delta: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...

    def _start(self, name: str) -> CallStart:
        self.num_calls += 1
        return CallStart(self.num_calls - 1, new_call_id(), name)

    @property
    def accepts_calls(self) -> bool:
        return self.parallel or self.num_calls == 0


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2, SmolLM2,
    Hermes), anywhere in the output. A call starts as soon as its name is known; its
    arguments stream up to (not including) the last `}` seen, which may close the call."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buf = ""
        self.cursor = 0  # text before this was handled
        self.in_call = False
        self.args_at: int | None = None  # where the current call's arguments start
        self.args_sent = 0
        self.skipping = False  # inside a call dropped because parallel is False

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
        while True:
            step = self._call_step() if self.in_call else self._content_step()
            if step is None:
                return events
            events += step

    def _content_step(self) -> list[Event] | None:
        rest = self.buf[self.cursor:]
        at = rest.find(self.START)
        if at < 0:
            keep = _partial_suffix(rest, self.START)
            text = rest[:len(rest) - keep]
            self.cursor += len(text)
            return self._content(text) or None
        self.cursor += at + len(self.START)
        self.in_call, self.args_at, self.args_sent = True, None, 0
        self.skipping = not self.accepts_calls
        return self._content(rest[:at])

    def _content(self, text: str) -> list[Event]:
        # Whitespace after a call only separates it from the next one.
        return [Content(text)] if text and (text.strip() or not self.num_calls) else []

    def _call_step(self) -> list[Event] | None:
        body = self.buf[self.cursor:]
        end = body.find(self.END)
        events: list[Event] = []
        if self.args_at is None and not self.skipping:
            m = _HERMES_HEAD.match(body)
            if m is not None:
                events.append(self._start(json.loads(f'"{m.group(1)}"')))
                self.args_at = m.end()
            elif end >= 0:
                return self._whole_call(body[:end], end)
        if self.args_at is not None:
            limit = end if end >= 0 else len(body) - _partial_suffix(body, self.END)
            upto = body.rfind("}", self.args_at, limit)
            upto = limit if upto < 0 else upto  # no brace yet: nothing can close the call
            if upto > self.args_at + self.args_sent:
                events.append(CallArgs(self.num_calls - 1, body[self.args_at + self.args_sent:upto]))
                self.args_sent = upto - self.args_at
        if end >= 0:
            self._close(end)
            return events
        return events or None

    def _whole_call(self, body: str, end: int) -> list[Event]:
        """A call whose name did not come first: parsed once complete."""
        self._close(end)
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return [Content(self.START + body + self.END)]  # not a call after all: show it
        start = self._start(name)
        return [start, CallArgs(start.index, json.dumps(args, ensure_ascii=False))]

    def _close(self, end: int) -> None:
        self.cursor += end + len(self.END)
        self.in_call, self.skipping = False, False

    def finish(self) -> list[Event]:
        if not self.in_call:
            rest = self.buf[self.cursor:]
            self.cursor = len(self.buf)
            return self._content(rest)
        body = self.buf[self.cursor:]
        self.cursor, self.in_call = len(self.buf), False
        if self.args_at is None:
            return [] if self.skipping else [Content(self.START + body)]
        # Cut short (length): the arguments so far, without the call's own closing brace.
        tail = body[self.args_at + self.args_sent:]
        return [CallArgs(self.num_calls - 1, tail)] if tail else []


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
    (several separated by `;`). Output that starts otherwise is content, streamed as it
    comes; output that starts with `{` is held and parsed at the end."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.buf = ""
        self.mode: str | None = None  # "content" | "json", decided by the first non-space character

    def feed(self, delta: str) -> list[Event]:
        if self.mode == "content":
            return [Content(delta)] if delta else []
        self.buf += delta
        head = self.buf.lstrip()
        if self.mode is None and head:
            self.mode = "json" if head.startswith("{") else "content"
            if self.mode == "content":
                text, self.buf = self.buf, ""
                return [Content(text)]
        return []

    def finish(self) -> list[Event]:
        text, self.buf = self.buf, ""
        if self.mode != "json":
            return [Content(text)] if text else []
        calls = _json_calls(text)
        if calls is None:
            return [Content(text)]
        events: list[Event] = []
        for name, args in calls if self.parallel else calls[:1]:
            start = self._start(name)
            events += [start, CallArgs(start.index, json.dumps(args, ensure_ascii=False))]
        return events


def _json_calls(text: str) -> list[tuple[str, object]] | None:
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    text = text.strip()
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, dict):
            return None
        calls.append((obj["name"], args))
        rest = text[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(text) - len(rest)
    return calls or None


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_family(chat_template: str | None) -> str:
    """The tool-call format a model writes, told by its chat template: Llama 3's templates
    use `<|eot_id|>`/`<|python_tag|>`; Hermes-style ones (and templates without tool
    support, which get the Hermes system prompt) use `<tool_call>`."""
    t = chat_template or ""
    if "<tool_call>" not in t and ("<|python_tag|>" in t or "<|eot_id|>" in t):
        return "llama3_json"
    return "hermes"


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Content):
                self.content += e.text
            elif isinstance(e, CallStart):
                self.calls.append(ToolCall(e.id, e.name))
            else:
                self.calls[e.index].arguments += e.text


def parse_all(parser: ToolParser, text: str) -> ParsedOutput:
    out = ParsedOutput()
    out.add(parser.feed(text))
    out.add(parser.finish())
    return out
