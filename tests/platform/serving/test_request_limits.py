"""Bounds checked before a request is admitted: JSON shape, prompt size in characters."""
from __future__ import annotations

import json

import orjson
import pytest

from loraplex.engine.errors import PromptTooLongError
from loraplex.platform.errors import BadRequestError, RateLimitedError
from loraplex.platform.serving.request_limits import (
    BodyBudget,
    check_chat_shape,
    check_choices,
    check_prompt_chars,
    check_prompt_count,
    json_depth,
    parse_json_object,
)
from loraplex.platform.settings import ServerLimits
from tests.platform.tenancy.test_throttle import Clock

LIMITS = ServerLimits(max_json_depth=8, max_messages=3, max_content_parts=2)


def _depth(value) -> int:
    """The reference: nesting depth of a parsed value, walked."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@pytest.mark.parametrize("value", [
    {}, {"a": [[[1]]]}, {"a": [[[[1]]]], "b": {}}, [1, [2, [3]], {"x": [[]]}],
    {"s": "[[[{{{", "t": "]]]}}}"}, {"s": "quote \" [[[ \\", "t": ["a\\", ["b\\\"[["]]},
    {"k[[[": {"v": "\\\\\"}}}}", "w": [["\"", "\\"]]}}, ["\u005c", "[\n\"]", {"a": "\\"}],
])
def test_json_depth_counts_brackets_outside_strings(value):
    raw = json.dumps(value).encode()
    assert json_depth(raw) == _depth(value)
    assert json_depth(orjson.dumps(value)) == _depth(value)


def test_nesting_depth():
    parse_json_object(b'{"a": [[[1]]], "s": "[[[[[[[[[[[[[[[[[["}', ServerLimits(max_json_depth=4))
    with pytest.raises(BadRequestError, match="deeper than 4"):
        parse_json_object(b'{"a": [[[[1]]]]}', ServerLimits(max_json_depth=4))
    deep = "[" * 100_000 + "]" * 100_000  # what orjson itself refuses: still a 400
    with pytest.raises(BadRequestError):
        parse_json_object(('{"messages": ' + deep + "}").encode(), LIMITS)
    with pytest.raises(BadRequestError, match="deeper than 8"):
        parse_json_object(('{"messages": ' + "[" * 20 + "]" * 20 + "}").encode(), LIMITS)


@pytest.mark.parametrize("raw", [b"", b"[]", b"nope", b'"text"', b"\xff\xfe"])
def test_bodies_that_are_not_objects(raw):
    with pytest.raises(BadRequestError):
        parse_json_object(raw, LIMITS)


def test_messages_and_parts_are_bounded():
    msg = {"role": "user", "content": "hi"}
    check_chat_shape({"messages": [msg] * 3}, LIMITS)
    with pytest.raises(BadRequestError, match="at most 3 messages") as err:
        check_chat_shape({"messages": [msg] * 4}, LIMITS)
    assert err.value.param == "messages"
    parts = [{"type": "text", "text": "a"}] * 3
    with pytest.raises(BadRequestError, match="at most 2 parts") as err:
        check_chat_shape({"messages": [msg, {"role": "user", "content": parts}]}, LIMITS)
    assert err.value.param == "messages[1].content"
    check_chat_shape({"messages": "not a list"}, LIMITS)  # the parser names that problem


def test_prompts_that_cannot_fit_are_refused_by_their_length():
    # 256 tokens of at most 10 characters each, with the normalizer margin of 4.
    check_prompt_chars({"prompt": "x" * 10_240}, False, 256, 10)
    with pytest.raises(PromptTooLongError, match="10241 characters"):
        check_prompt_chars({"prompt": "x" * 10_241}, False, 256, 10)
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 6000}]},
                         {"role": "user", "content": "z" * 6000}]}
    with pytest.raises(PromptTooLongError):
        check_prompt_chars(chat, True, 256, 10)
    check_prompt_chars({"prompt": [1, 2, 3]}, False, 256, 10)  # token ids: counted by the parser


def test_tool_definitions_count_toward_the_prompt_bound():
    messages = [{"role": "user", "content": "hi"}]
    # Keys count too: a tool list of long property names and no string values is still text.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p" * 100 + str(i): {} for i in range(110)}}}}]
    with pytest.raises(PromptTooLongError, match="tool definitions"):
        check_prompt_chars({"messages": messages, "tools": tools}, True, 256, 10)
    check_prompt_chars({"messages": messages, "tools": tools[:0]}, True, 256, 10)
    check_prompt_chars({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]},
                       True, 256, 10)


def test_each_prompt_of_a_list_is_bounded_on_its_own():
    check_prompt_chars({"prompt": ["x" * 10_240, "y" * 10_240]}, False, 256, 10)
    with pytest.raises(PromptTooLongError, match="prompt 1 has 10241 characters"):
        check_prompt_chars({"prompt": ["x", "y" * 10_241]}, False, 256, 10)


def test_prompt_lists_and_choices_are_capped():
    limits = ServerLimits(max_prompts=3, max_choices=8)
    check_prompt_count({"prompt": ["a", "b", "c"]}, limits)
    check_prompt_count({"prompt": list(range(50))}, limits)  # one prompt of token ids
    with pytest.raises(BadRequestError, match="at most 3 prompts per request, got 4") as err:
        check_prompt_count({"prompt": [[1], [2], [3], [4]]}, limits)
    assert err.value.param == "prompt"
    check_choices(8, limits)
    with pytest.raises(BadRequestError, match="over the cap of 8 sequences") as err:
        check_choices(9, limits)
    assert err.value.param == "n"


def test_a_tenants_body_budget_holds_one_largest_body_and_refills_at_its_rate():
    clock = Clock()
    budget = BodyBudget(rate=1000, burst=4000, clock=clock)
    budget.admit("a", 4000)  # a full bucket takes the largest body at once
    with pytest.raises(RateLimitedError) as e:
        budget.admit("a", 1500)
    assert e.value.retry_after == pytest.approx(1.5)  # until 1500 bytes have come back
    budget.admit("b", 4000)  # another tenant's bucket is its own
    clock.now += 1.5
    budget.admit("a", 1500)
    with pytest.raises(RateLimitedError):
        budget.admit("a", 1)
    clock.now += 100  # never more than the burst
    budget.admit("a", 4000)
    with pytest.raises(RateLimitedError):
        budget.admit("a", 1)


def test_a_body_read_without_a_length_is_charged_after_it_and_can_leave_a_debt():
    clock = Clock()
    budget = BodyBudget(rate=1000, burst=1000, clock=clock)
    budget.debit("a", 3000)  # a chunked body: known only once read
    clock.now += 2.5
    with pytest.raises(RateLimitedError):
        budget.admit("a", 600)  # 2,000 bytes owed, 2,500 earned back: 500 in the bucket
    clock.now += 0.5  # 1,000 in the bucket
    budget.admit("a", 1000)


def test_the_burst_is_never_below_one_second_of_the_rate():
    assert BodyBudget(rate=5000, burst=10).burst == 5000


def _walked_chars(value, keys: bool = False) -> int:
    """The reference: characters of every string inside `value` (and of keys), walked."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum((len(k) if keys else 0) + _walked_chars(v, keys) for k, v in value.items())
    if isinstance(value, list):
        return sum(_walked_chars(v, keys) for v in value)
    return 0


@pytest.mark.parametrize("keys", [False, True])
@pytest.mark.parametrize("value", [
    [{"role": "user", "content": "hello"}],
    [{"role": "user", "content": [{"type": "text", "text": "héllo wörld ✓ 🎉"}, {"type": "image_url"}]}],
    {'q"uote': 'a "quoted" \\ back\\slash', "n": ["line\nbreak\ttab", "\x00\x01\x1f ctl", "\u2028"]},
    {"": "", "k": ["", {"": [1, 2.5, None, True]}], "\\": '\\"'},
    [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"p" * 100 + str(i): {}
                                                                                  for i in range(3)}}}}],
    [], {},
])
def test_text_chars_counts_strings_as_a_walk_does(value, keys):
    from loraplex.platform.serving.request_limits import _text_chars

    assert _text_chars(value, keys=keys) == _walked_chars(value, keys)
