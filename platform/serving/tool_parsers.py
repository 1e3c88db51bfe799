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
    arguments stream up to (not including) the last `}` seen, which may close the call.

    Linear in the output: each delta is scanned once, with at most a marker's length held
    back from the previous one; a call's head is matched within `HEAD_MAX` characters (a
    longer one is parsed whole at its end), and unsent arguments are kept as a list of
    pieces, joined when a `}` lets some of them go."""

    START, END = "<tool_call>", "</tool_call>"
    HEAD_MAX = 1024  # characters before a call's arguments: `{"name": "...", "arguments": `

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.held = ""  # text that may be the start of a marker (START outside a call, END inside)
        self.in_call = False
        self._open(skipping=False)
        self.in_call = False

    def _open(self, skipping: bool) -> None:
        self.in_call, self.skipping = True, skipping  # skipping: a call dropped as parallel is False
        self.head = ""  # the call's text until its arguments begin (at most HEAD_MAX)
        self.whole: list[str] | None = None  # a call whose head did not match: kept to parse at its end
        self.args_open = False
        self.pending: list[str] = []  # arguments not sent yet
        self.pending_len = 0
        self.brace = -1  # offset in the pending text of its last `}` (-1: none since the arguments began)

    def feed(self, delta: str) -> list[Event]:
        events: list[Event] = []
        while delta:
            delta = self._call_feed(delta, events) if self.in_call else self._content_feed(delta, events)
        return events

    def _content_feed(self, delta: str, events: list[Event]) -> str:
        text, self.held = self.held + delta, ""
        at = text.find(self.START)
        if at < 0:
            keep = _partial_suffix(text, self.START)
            self.held = text[len(text) - keep:]
            events += self._content(text[:len(text) - keep])
            return ""
        events += self._content(text[:at])
        self._open(skipping=not self.accepts_calls)
        return text[at + len(self.START):]

    def _content(self, text: str) -> list[Event]:
        # Whitespace after a call only separates it from the next one.
        return [Content(text)] if text and (text.strip() or not self.num_calls) else []

    def _call_feed(self, delta: str, events: list[Event]) -> str:
        text, self.held = self.held + delta, ""
        at = text.find(self.END)
        if at < 0:
            keep = _partial_suffix(text, self.END)
            self.held = text[len(text) - keep:]
            self._body(text[:len(text) - keep], events)
            return ""
        self._body(text[:at], events)
        events += self._close()
        return text[at + len(self.END):]

    def _body(self, part: str, events: list[Event]) -> None:
        if self.skipping or not part:
            return
        if self.whole is not None:
            self.whole.append(part)
        elif not self.args_open:
            self.head += part
            m = _HERMES_HEAD.match(self.head)
            if m is not None:
                events.append(self._start(json.loads(f'"{m.group(1)}"')))
                rest, self.head, self.args_open = self.head[m.end():], "", True
                self._args(rest, events)
            elif len(self.head) > self.HEAD_MAX:
                self.whole, self.head = [self.head], ""
        else:
            self._args(part, events)

    def _args(self, part: str, events: list[Event]) -> None:
        brace = part.rfind("}")
        if brace >= 0:
            self.brace = self.pending_len + brace
        if part:
            self.pending.append(part)
            self.pending_len += len(part)
        upto = self.brace if self.brace >= 0 else self.pending_len  # no brace yet: nothing can close the call
        if upto > 0:
            text = "".join(self.pending)
            events.append(CallArgs(self.num_calls - 1, text[:upto]))
            rest = text[upto:]
            self.pending, self.pending_len = ([rest] if rest else []), len(rest)
            self.brace = 0 if self.brace >= 0 else -1

    def _close(self) -> list[Event]:
        """At the call's END: its arguments were sent up to their closing brace; a call
        whose head never matched is parsed whole."""
        whole = self.whole if self.whole is not None else (None if self.args_open or self.skipping else [self.head])
        self.in_call = False
        if whole is None:
            return []
        return self._whole_call("".join(whole))

    def _whole_call(self, body: str) -> list[Event]:
        """A call whose name did not come first: parsed once complete."""
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return [Content(self.START + body + self.END)]  # not a call after all: show it
        start = self._start(name)
        return [start, CallArgs(start.index, json.dumps(args, ensure_ascii=False))]

    def finish(self) -> list[Event]:
        held, self.held = self.held, ""
        if not self.in_call:
            return self._content(held)
        self.in_call = False
        if self.skipping:
            return []
        if not self.args_open:
            body = "".join(self.whole) if self.whole is not None else self.head
            return [Content(self.START + body + held)]
        # Cut short (length): the arguments so far, without the call's own closing brace.
        tail = "".join(self.pending) + held
        return [CallArgs(self.num_calls - 1, tail)] if tail else []


class Llama3JsonParser(ToolParser):
    """Llama 3's JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
    (several separated by `;`). Output that starts otherwise is content, streamed as it
    comes; output that starts with `{` is held and parsed at the end.

    Linear in the output: each delta is looked at once, and held text is kept as a list
    of pieces joined once, not rescanned or copied on every delta."""

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self.held: list[str] = []  # the output while it is not known to be content
        self.mode: str | None = None  # "content" | "json", decided by the first non-space character

    def feed(self, delta: str) -> list[Event]:
        if self.mode == "content":
            return [Content(delta)] if delta else []
        self.held.append(delta)
        if self.mode is None:
            # Everything held before this delta is whitespace: only the delta can decide.
            head = delta.lstrip()
            if head:
                self.mode = "json" if head.startswith("{") else "content"
                if self.mode == "content":
                    text, self.held = "".join(self.held), []
                    return [Content(text)]
        return []

    def finish(self) -> list[Event]:
        text, self.held = "".join(self.held), []
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
