"""What one request may make the server do is capped, and over a cap the answer is a 400
naming it (the official openai client against a live server over the tiny Llama):
schema size and shape, tool lists, logit_bias entries, n x max_tokens (x top_logprobs);
one tenant's slow grammar compile holds up no other tenant."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

from loraplex.engine.request import MAX_LOGIT_BIAS
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured import spec as caps
from loraplex.engine.structured.compile_pool import CompilePool

MSG = [{"role": "user", "content": "x"}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _refused(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.response.json()["error"]


def _wide(n: int, description: str = "") -> dict:
    prop = {"type": "string", **({"description": description} if description else {})}
    return {"type": "object", "properties": {f"p{i}": prop for i in range(n)}}


@pytest.mark.parametrize("schema, cap", [
    (_wide(30_000, 'd' * 40), "max_schema_bytes"),  # about 2 MiB, as a tenant once sent
    (_wide(caps.MAX_SCHEMA_PROPERTIES + 1), "max_schema_properties"),
    ({"type": "object", "properties": {"e": {"enum": list(range(caps.MAX_SCHEMA_ENUM_VALUES + 1))}}},
     "max_schema_enum_values"),
])
def test_schemas_over_a_cap_are_400_naming_it(oa, schema, cap):
    err = _refused(lambda: oa.client().chat.completions.create(
        model=oa.model, messages=MSG, max_tokens=4, response_format=_schema_format(schema)))
    assert cap in err["message"] and err["param"] == "response_format"


def test_tool_schemas_share_the_caps(oa):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _wide(caps.MAX_SCHEMA_PROPERTIES // 4)}}
             for i in range(5)]
    err = _refused(lambda: oa.client().chat.completions.create(
        model=oa.model, messages=MSG, max_tokens=4, tools=tools, tool_choice="required"))
    assert "max_schema_properties" in err["message"] and err["param"] == "tools"


@pytest.mark.parametrize("extra, cap", [
    ({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}}, "max_logit_bias_entries"),
    ({"n": 64, "max_tokens": 8000}, "max_request_output_tokens"),
    ({"max_tokens": 8000, "logprobs": True, "top_logprobs": 20}, "max_request_logprob_entries"),
])
def test_what_one_request_may_produce_is_capped(oa, extra, cap):
    err = _refused(lambda: oa.client().chat.completions.create(model=oa.model, messages=MSG, extra_body=extra))
    assert cap in err["message"] and err["type"] == "invalid_request_error"


def test_refused_schemas_leave_other_tenants_served(oa):
    """Many oversized schemas from one tenant at once; another tenant's json_object request
    is answered alongside them and every oversized one is a 400, none a 5xx."""
    big = _schema_format(_wide(30_000, 'd' * 40))

    def flood(_: int) -> int:
        try:
            oa.client("acme").chat.completions.create(model=oa.model, messages=MSG, max_tokens=4,
                                                      response_format=big)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    with ThreadPoolExecutor(6) as pool:
        refused = pool.map(flood, range(6))
        other = oa.client("beta").chat.completions.create(model=oa.model, messages=MSG, max_tokens=8, temperature=0,
                                                          response_format={"type": "json_object"})
        assert set(refused) == {400}
    assert other.choices[0].message.content.lstrip().startswith("{")


def test_tool_definitions_too_long_for_the_context_are_413_before_parsing(oa):
    """About 3.5 MiB of tools (a chat template would render them all into the prompt)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 3500}} for i in range(1000)]
    with pytest.raises(openai.APIStatusError) as e:
        oa.client().chat.completions.create(model=oa.model, messages=MSG, max_tokens=2, tools=tools)
    assert e.value.status_code == 413
    err = e.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and "tool definitions" in err["message"]


SLOW = {"type": "object", "title": "slow", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"]}


@contextmanager
def _held_compiles(oa, **pool) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The server's compile pool, with the `slow` schema's compile running until the test
    lets it finish (every compile is real)."""
    engine = oa.engine.engine
    release, started = threading.Event(), threading.Event()

    def compile_fn(spec: StructuredOutput):
        if spec.kind == "json_schema" and json.loads(spec.spec).get("title") == "slow":
            started.set()
            release.wait()
        return engine.grammars.compile(spec)

    saved, engine.grammar_pool = engine.grammar_pool, CompilePool(compile_fn, **pool)
    try:
        yield release, started
    finally:
        release.set()
        engine.grammar_pool.close()
        engine.grammar_pool = saved


def _slow_request(oa, outcome: dict) -> threading.Thread:
    def run() -> None:
        try:
            outcome["ok"] = oa.client("acme").chat.completions.create(
                model=oa.model, messages=MSG, max_tokens=20, temperature=0, response_format=_schema_format(SLOW))
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_tenants_slow_compile_holds_up_no_other_tenant(oa):
    outcome: dict = {}
    with _held_compiles(oa, threads=2, deadline=600) as (release, started):
        slow = _slow_request(oa, outcome)
        assert started.wait(120)
        other = oa.client("beta").chat.completions.create(model=oa.model, messages=MSG, max_tokens=8, temperature=0,
                                                          response_format={"type": "json_object"})
        assert slow.is_alive() and not outcome  # served while acme's grammar was still compiling
        release.set()
        slow.join(120)
    assert other.choices[0].message.content.lstrip().startswith("{")
    assert json.loads(outcome["ok"].choices[0].message.content)["a"] in range(10)


def test_a_compile_past_its_deadline_is_a_400_naming_it(oa):
    outcome: dict = {}
    with _held_compiles(oa, threads=2, deadline=0.5) as (release, started):
        slow = _slow_request(oa, outcome)
        slow.join(120)
        assert started.is_set()
    err = outcome["error"]
    assert err.status_code == 400 and err.body["code"] == "grammar_compile_timeout"
    assert "compile_deadline" in err.body["message"]
