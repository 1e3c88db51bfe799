"""Constrained generation through the whole engine on the tiny llama (SmolLM2's tokenizer)."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import jsonschema
import pytest

from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.engine.structured import StructuredOutput, UnsupportedSchemaError
from loraplex.engine.structured.compile_pool import CompilePool

# Bounded strings, numbers and arrays: a random model's greedy output still ends.
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 4}},
        "required": ["tags", "scores"]},
    "required-optional": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": {"type": ["string", "null"], "maxLength": 6}},
        "required": ["id"], "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"]}}},
]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
                                  cache=CacheConfig(block_size=16, num_blocks=512),
                                  scheduler=SchedulerConfig(max_num_seqs=16)))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _json(schema: dict, strict: bool = True, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 120), temperature=kw.pop("temperature", 0),
                          structured_output=StructuredOutput.json_schema(schema, strict=strict), **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_schema_constrained_output_validates(engine, name, temperature):
    schema = SCHEMAS[name]
    outs = engine.generate(_prompts(3, seed=len(name)), _json(schema, temperature=temperature, seed=4))
    for out in outs:
        assert out.finish_reason == "stop", out.new_text  # the grammar ended it with EOS
        jsonschema.validate(json.loads(out.new_text), schema)


def test_json_object_gives_an_object(engine):
    sp = SamplingParams(max_tokens=300, temperature=0, structured_output=StructuredOutput.json_object())
    for out in engine.generate(_prompts(2, seed=9), sp):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.new_text), dict)
        else:  # a random model may write a long object; what it wrote is an object's prefix
            assert out.new_text.lstrip().startswith("{")


def test_constraints_do_not_leak_into_unconstrained_rows(engine):
    prompts = _prompts(8, seed=3)
    free = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True, repetition_penalty=1.2)]
    alone = engine.generate(prompts[:4], [free[i % 2] for i in range(4)])
    params = [free[i % 2] if i < 4 else _json(SCHEMAS[sorted(SCHEMAS)[i % 4]]) for i in range(8)]
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    mixed = engine.generate([prompts[i] for i in order], [params[i] for i in order])
    by_prompt = dict(zip(order, mixed))
    assert [by_prompt[i].new_token_ids for i in range(4)] == [o.new_token_ids for o in alone]
    for i in range(4, 8):
        jsonschema.validate(json.loads(by_prompt[i].new_text), SCHEMAS[sorted(SCHEMAS)[i % 4]])


def _calls(text: str) -> list[dict]:
    parts = [p for p in text.split("</tool_call>") if p.strip()]
    calls = []
    for p in parts:
        head, body = p.strip().split("\n", 1)
        assert head == "<tool_call>"
        calls.append(json.loads(body))
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}},
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_grammar_yields_valid_calls(engine, choice):
    spec = StructuredOutput.tool_call(TOOLS, choice, parallel_tool_calls=False)
    sp = SamplingParams(max_tokens=120, temperature=0.7, seed=5, structured_output=spec)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in engine.generate(_prompts(4, seed=1), sp):
        assert out.finish_reason == "stop", out.new_text
        calls = _calls(out.new_text)
        assert len(calls) == 1 and set(calls[0]) == {"name", "arguments"}
        if isinstance(choice, dict):
            assert calls[0]["name"] == choice["function"]["name"]
        jsonschema.validate(calls[0]["arguments"], schemas[calls[0]["name"]])


def test_parallel_tool_calls_are_each_valid(engine):
    spec = StructuredOutput.tool_call(TOOLS, "required", parallel_tool_calls=True)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in engine.generate(_prompts(3, seed=2), SamplingParams(max_tokens=200, temperature=1.0, seed=8,
                                                                  structured_output=spec)):
        calls = _calls(out.new_text) if out.finish_reason == "stop" else []
        for call in calls:
            jsonschema.validate(call["arguments"], schemas[call["name"]])


def test_unsupported_schema_is_refused_at_add_request(engine):
    with pytest.raises(UnsupportedSchemaError, match="Lookbehind"):
        engine.add_request([5, 6, 7], _json({"type": "string", "pattern": "(?<=a)b"}))
    assert not engine.has_unfinished_requests()


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    from loraplex.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([5, 6], SamplingParams(logit_bias={engine.arch.vocab_size: 1}))


def test_grammars_are_compiled_once_per_schema(engine):
    pool = engine.grammar_pool
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    misses, hits = pool.misses, pool.hits
    engine.generate(_prompts(3, seed=5), _json(schema, max_tokens=20))
    assert (pool.misses - misses, pool.hits - hits) == (1, 2)
    engine.generate(_prompts(1, seed=6), _json(schema, max_tokens=20))
    assert (pool.misses - misses, pool.hits - hits) == (1, 3)


def test_the_engine_thread_never_compiles_and_a_slow_compile_stalls_no_one(engine):
    """Tenant A's schema compiles for as long as the test holds it; tenant B's json_object
    request (and a plain one) are served meanwhile, and A's runs once its grammar is ready."""
    gate, started, threads = threading.Event(), threading.Event(), []
    slow_spec = StructuredOutput.json_schema(SCHEMAS["enum"], strict=True)

    def compile_fn(spec: StructuredOutput):
        threads.append(threading.current_thread().name)
        if spec == slow_spec:
            started.set()
            gate.wait()
        return engine.grammars.compile(spec)

    saved = engine.grammar_pool
    engine.grammar_pool = CompilePool(compile_fn, threads=2, deadline=600)
    aengine = AsyncEngine(engine)
    events: list[str] = []

    async def run(name: str, sampling: SamplingParams, tenant: str) -> str:
        text = "".join([o.new_text async for o in aengine.generate(_prompts(1, seed=len(name))[0], sampling,
                                                                   tenant=tenant)])
        events.append(name)
        return text

    async def main() -> str:
        slow = asyncio.ensure_future(run("A", _json(SCHEMAS["enum"], max_tokens=40), "a"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        await run("B", SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutput.json_object()),
                  "b")
        await run("plain", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "b")
        assert not slow.done()
        gate.set()
        return await slow

    try:
        text = asyncio.run(asyncio.wait_for(main(), 600))
    finally:
        gate.set()
        aengine.shutdown()
        engine.grammar_pool.close()
        engine.grammar_pool = saved
    assert events == ["B", "plain", "A"]
    jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    assert threads and all(t.startswith("loraplex-grammar") for t in threads)
