"""Tool-call parsers: the same content and calls whether the text comes whole or in pieces."""
from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from loraplex.platform.serving.tool_parsers import (
    CallArgs,
    CallStart,
    Content,
    HermesParser,
    Llama3JsonParser,
    ParsedOutput,
    parse_all,
    parser_family,
)

HERMES_CASES = [
    # (output, content, [(name, arguments)])
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris", "days": 3})]),
    ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": {"y": [1, {"z": "}"}]}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "Let me check.\n", [("a", {"x": {"y": [1, {"z": "}"}]}}), ("b", {})]),
    ('<tool_call>{"arguments": {"q": 1}, "name": "late_name"}</tool_call>', "", [("late_name", {"q": 1})]),
    ("no calls here, just a < sign and <tool", "no calls here, just a < sign and <tool", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    # A head longer than HEAD_MAX: parsed whole at the call's end.
    ('<tool_call>{"name": "' + "n" * 1500 + '", "arguments": {"a": "}"}}</tool_call>x', "x",
     [("n" * 1500, {"a": "}"})]),
]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def _streamed(parser, pieces: list[str]) -> ParsedOutput:
    out = ParsedOutput()
    for p in pieces:
        out.add(parser.feed(p))
    out.add(parser.finish())
    return out


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_streamed_agree(text, content, calls):
    whole = parse_all(HermesParser(), text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    rng = random.Random(0)
    for _ in range(30):
        got = _streamed(HermesParser(), _pieces(text, rng))
        assert got.content == whole.content
        assert [(c.name, c.arguments) for c in got.calls] == [(c.name, c.arguments) for c in whole.calls]
    by_char = _streamed(HermesParser(), list(text))
    assert [(c.name, c.arguments) for c in by_char.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_hermes_streams_the_name_before_the_arguments_end():
    p = HermesParser()
    events = p.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert isinstance(events[0], CallStart) and events[0].name == "f" and events[0].id.startswith("call_")
    assert events[1:] == [CallArgs(0, '{"city": "Pa')]
    assert p.feed('ris"}') == [CallArgs(0, 'ris"')]  # that brace may close the call: held
    assert p.feed('}\n</tool_call>') == [CallArgs(0, '}')]
    assert p.finish() == []


def test_hermes_without_parallel_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    out = parse_all(HermesParser(parallel=False), text)
    assert [c.name for c in out.calls] == ["a"] and out.content == ""


def test_hermes_cut_short_gives_the_partial_call():
    out = parse_all(HermesParser(), '<tool_call>{"name": "a", "arguments": {"x": 1')
    assert out.calls[0].name == "a" and out.calls[0].arguments == '{"x": 1'


@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "", [("a", {"x": 1}), ("b", {})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    # Leading whitespace: the first character after it decides, and the whitespace is kept.
    ('\n {"name": "f", "parameters": {}}', "", [("f", {})]),
    (" \n The weather", " \n The weather", []),
])
def test_llama3_json(text, content, calls):
    whole = parse_all(Llama3JsonParser(), text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    got = _streamed(Llama3JsonParser(), _pieces(text, random.Random(1)))
    assert (got.content, [(c.name, c.arguments) for c in got.calls]) == \
        (whole.content, [(c.name, c.arguments) for c in whole.calls])


def test_llama3_content_streams_at_once():
    p = Llama3JsonParser()
    assert p.feed("Hel") == [Content("Hel")] and p.feed("lo") == [Content("lo")]


def test_family_is_told_by_the_chat_template():
    assert parser_family(None) == "hermes"
    assert parser_family("{{'<|im_start|>'}}{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_family("{{'<|start_header_id|>'}}...<|eot_id|>{% if tools %}<|python_tag|>{% endif %}") \
        == "llama3_json"


def test_hermes_holds_bounded_state_per_delta():
    """What the parser rescans on each delta stays bounded however long a call runs (the
    8,000 deltas of one unterminated name that once cost seconds of event-loop time)."""
    p = HermesParser()
    text = '<tool_call>{"name": "'
    p.feed(text)
    for _ in range(8000):
        p.feed("abcd")
        text += "abcd"
        assert len(p.head) <= HermesParser.HEAD_MAX and len(p.held) < len(HermesParser.END)
    assert [e.text for e in p.finish() if isinstance(e, Content)] == [text]  # cut short: shown as it was
    p = HermesParser()
    p.feed('<tool_call>{"name": "f", "arguments": {"a": "')
    for _ in range(8000):
        p.feed("ab}c")  # every delta lets the text before its brace go
        assert p.pending_len <= len("}c")


def test_llama3_json_holds_a_long_call_with_linear_work():
    """A long call held to its end costs memory work linear in its length: what each delta
    allocates is its own share (a list slot, the empty events), never a copy or strip of
    everything held so far, which over 8,000 deltas allocates hundreds of megabytes. Counted
    with tracemalloc: each feed's peak above what was allocated before it."""
    deltas = ["\n", '{"name": "f", "parameters": {"a": "'] + ["abcdefghijklmnop"] * 8000 + ['"}}']
    p = Llama3JsonParser()
    already = tracemalloc.is_tracing()
    if not already:
        tracemalloc.start()
    try:
        allocated = 0
        for d in deltas:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            assert p.feed(d) == []
            allocated += tracemalloc.get_traced_memory()[1] - before
    finally:
        if not already:
            tracemalloc.stop()
    fed = sum(map(len, deltas))
    # A few bytes per character fed; copying the held text on every delta is thousands.
    assert allocated < 64 * fed, (allocated, fed)
    (start, args) = p.finish()
    assert isinstance(start, CallStart) and start.name == "f"
    assert json.loads(args.text) == {"a": "abcdefghijklmnop" * 8000}
