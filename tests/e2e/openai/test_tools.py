"""Tool calling with the official openai client against SmolLM2-135M-Instruct (its chat
template has no tool support: the Hermes prompt and <tool_call> format are used)."""
from __future__ import annotations

import json

import jsonschema
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _chat(live, **kw):
    return live.client().chat.completions.create(model=live.model, **{"max_tokens": 80, **kw})


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


@pytest.mark.parametrize("choice, name", [("required", None),
                                          ({"type": "function", "function": {"name": "add"}}, "add"),
                                          ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_and_named_choice_give_valid_calls(smol, choice, name, temperature):
    r = _chat(smol, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=temperature, seed=3,
              parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    _check_call(c.message.tool_calls[0])
    if name:
        assert c.message.tool_calls[0].function.name == name


def test_parallel_required_calls_are_each_valid(smol):
    r = _chat(smol, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5, max_tokens=160)
    c = r.choices[0]
    assert c.message.tool_calls  # the grammar starts the output with a call
    if c.finish_reason == "tool_calls":  # (not cut short by max_tokens)
        for call in c.message.tool_calls:
            _check_call(call)
    assert len({call.id for call in c.message.tool_calls or []}) == len(c.message.tool_calls or [])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_deltas_assemble_to_the_same_call(smol, choice):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, parallel_tool_calls=False)
    whole = _chat(smol, **kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    reasons, firsts = [], []
    for chunk in _chat(smol, **kw, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    firsts.append(d)
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reasons == ["tool_calls"] and list(calls) == [0]
    assert firsts[0].id and firsts[0].type == "function" and firsts[0].function.name == whole.function.name
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)


def test_a_tool_result_round_trips(smol):
    first = _chat(smol, messages=ASK, tools=TOOLS, tool_choice={"type": "function",
                                                                "function": {"name": "get_weather"}}, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"city": json.loads(call.function.arguments)["city"],
                                             "temperature": 21, "sky": "sunny"})}]
    r = _chat(smol, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content
    # The call and its result were in the prompt: more prompt than the question alone.
    alone = _chat(smol, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + 30


def test_auto_gives_content_or_valid_calls(smol):
    r = _chat(smol, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            assert call.function.name and json.loads(call.function.arguments) is not None
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")
