"""Parsing of the OpenAI fields beyond plain sampling, with SmolLM2's real tokenizer (whose
template has no tool support) and a copy carrying a Qwen2-style template (which has)."""
from __future__ import annotations

import json
import shutil

import pytest

from loraplex.engine.structured import StructuredOutput
from loraplex.engine.tokenizer import Tokenizer
from loraplex.platform.errors import BadRequestError
from loraplex.platform.serving.protocol import parse_chat, parse_completion
from loraplex.platform.serving.tools import TOOLS_SYSTEM_PROMPT

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# The tool turns of Qwen2.5's template, trimmed.
QWEN_STYLE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{%- for tool in tools %}
{{ tool | tojson }}{%- endfor %}
</tools><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def qwen_tok(smollm2_dir, tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("qwen_style_tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / f, d / f)
    (d / "chat_template.jinja").write_text(QWEN_STYLE)
    return Tokenizer(d)


def _text(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def test_response_format_becomes_a_grammar(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"messages": USER, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": schema, "strict": True}}}
    assert parse_chat(body, tok, 2048).sampling.structured_output == StructuredOutput.json_schema(schema, True)
    body["response_format"] = {"type": "json_object"}
    assert parse_chat(body, tok, 2048).sampling.structured_output == StructuredOutput.json_object()
    body["response_format"] = {"type": "text"}
    assert parse_chat(body, tok, 2048).sampling.structured_output is None


@pytest.mark.parametrize("fmt, named", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}, "b": {"type": "array", "uniqueItems": True}}}}},
     ["'not' at #/properties/a", "'uniqueItems' at #/properties/b"]),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, ["name"]),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}, ["strict"]),
])
def test_unsupported_response_formats_are_named(tok, fmt, named):
    with pytest.raises(BadRequestError) as e:
        parse_chat({"messages": USER, "response_format": fmt}, tok, 2048)
    assert e.value.param == "response_format"
    for part in named:
        assert part in str(e.value)


@pytest.mark.parametrize("field, hint", [("functions", "use tools"), ("function_call", "use tool_choice"),
                                         ("audio", "text only"), ("best_of", "unknown field"),
                                         ("echo", "unknown field"), ("foo", "unknown field")])
def test_unknown_and_unsupported_chat_fields_are_refused(tok, field, hint):
    with pytest.raises(BadRequestError) as e:
        parse_chat({"messages": USER, field: [1]}, tok, 2048)
    assert e.value.param == field and hint in str(e.value)


def test_harmless_fields_are_accepted(tok):
    body = {"messages": USER, "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "modalities": ["text"], "prompt_cache_key": "abc", "safety_identifier": "s"}
    assert parse_chat(body, tok, 2048).n == 1
    with pytest.raises(BadRequestError) as e:
        parse_chat({**body, "service_tier": "flex"}, tok, 2048)
    assert e.value.param == "service_tier"


def test_penalties_bias_and_n_reach_the_sampling_params(tok):
    r = parse_chat({"messages": USER, "n": 3, "seed": 5, "presence_penalty": 0.5, "frequency_penalty": -1,
                    "repetition_penalty": 1.3, "min_p": 0.1, "logit_bias": {"42": -100, "7": 5}}, tok, 2048)
    sp = r.sampling
    assert (r.n, sp.n, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == \
        (3, 3, 0.5, -1.0, 1.3, 0.1)
    assert sp.logit_bias == ((7, 5.0), (42, -100.0))


def test_completion_echo_best_of_and_suffix(tok):
    r = parse_completion({"prompt": "Hello there", "echo": True, "logprobs": 2, "best_of": 3, "n": 2}, tok, 2048)
    assert (r.echo, r.n, r.sampling.n, r.sampling.prompt_logprobs, r.sampling.logprobs) == \
        (["Hello there"], 2, 3, 2, 2)
    assert r.best_of
    r = parse_completion({"prompt": tok.encode("Hi"), "echo": True, "best_of": 2}, tok, 2048)
    assert r.echo == ["Hi"] and r.sampling.logprobs == 0 and r.logprobs is None  # best_of ranks by logprobs
    with pytest.raises(BadRequestError, match="fill-in-the-middle") as e:
        parse_completion({"prompt": "def f(", "suffix": "return x"}, tok, 2048)
    assert e.value.param == "suffix"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests(tok, body, param):
    with pytest.raises(BadRequestError) as e:
        parse_chat({"messages": USER, **body}, tok, 2048)
    assert e.value.param == param


def test_tools_without_template_support_get_the_hermes_prompt(tok):
    r = parse_chat({"messages": USER, "tools": [WEATHER]}, tok, 2048)
    text = _text(tok, r.prompt)
    assert TOOLS_SYSTEM_PROMPT.split("\n")[0] in text and json.dumps(WEATHER) in text
    assert r.tools.choice == "auto" and r.sampling.structured_output is None and r.tools.family == "hermes"
    none = parse_chat({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, tok, 2048)
    assert "<tools>" not in _text(tok, none.prompt) and none.tools.new_parser() is None
    named = parse_chat({"messages": USER, "tools": [WEATHER],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tok, 2048)
    assert named.sampling.structured_output.kind == "tool_call"


def _round_trip(with_content: bool) -> list[dict]:
    return USER + [
        {"role": "assistant", "content": "Checking." if with_content else None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]


@pytest.mark.parametrize("which", ["tok", "qwen_tok"])
def test_tool_calls_and_results_are_rendered_back(request, which):
    t = request.getfixturevalue(which)
    r = parse_chat({"messages": _round_trip(False), "tools": [WEATHER]}, t, 2048)
    text = _text(t, r.prompt)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in text
    assert "<tools>" in text and '"get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_tool_call_arguments_in_history_are_refused(tok):
    msgs = _round_trip(True)
    msgs[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(BadRequestError) as e:
        parse_chat({"messages": msgs, "tools": [WEATHER]}, tok, 2048)
    assert e.value.param == "messages"
