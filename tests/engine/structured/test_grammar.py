"""Specs, the unsupported-feature check, the schema caps, the compiled-grammar cache and
the per-request matcher."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.structured import SchemaTooLargeError, StructuredOutput, UnsupportedSchemaError
from loraplex.engine.structured import spec as caps
from loraplex.engine.structured.compile_pool import CompilePool
from loraplex.engine.structured.grammar import GrammarCompiler, RequestGrammar
from loraplex.engine.tokenizer import Tokenizer

OBJ = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}


@pytest.mark.parametrize("schema,named", [
    ({"not": {"type": "string"}}, ["'not' at #"]),
    ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}},
     ["'uniqueItems' at #/properties/x"]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, ["'if' at #", "'then' at #"]),
    ({"anyOf": [{"type": "array", "contains": {"type": "integer"}}, {"$ref": "https://x.org/s.json"}]},
     ["'contains' at #/anyOf/0", "'$ref' to another document (https://x.org/s.json) at #/anyOf/1"]),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, ["'allOf' with several schemas at #"]),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, ["'dependentRequired' at #"]),
])
def test_unenforceable_features_are_refused_by_name(schema, named):
    with pytest.raises(UnsupportedSchemaError) as err:
        StructuredOutput.json_schema(schema)
    assert sorted(err.value.features) == sorted(named)
    for name in named:
        assert name in str(err.value)
    assert isinstance(err.value, InvalidRequestError)  # the API answers 400


def test_keywords_used_as_property_names_are_not_features():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
              "$defs": {"contains": {"type": "boolean"}}}
    StructuredOutput.json_schema(schema)


@pytest.mark.parametrize("tools,choice,message", [
    ([], "required", "non-empty list"),
    ([{"type": "function", "function": {"name": "f"}}], "auto", "does not constrain"),
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}}, "'g'"),
    ([{"type": "retrieval"}], "required", r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "required", "twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}], "required", "'not' at #"),
])
def test_bad_tool_specs_are_refused(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutput.tool_call(tools, choice)


def test_schema_must_be_an_object_of_plain_json():
    with pytest.raises(InvalidRequestError, match="JSON object"):
        StructuredOutput.json_schema("not a schema")
    with pytest.raises(InvalidRequestError, match="plain JSON"):
        StructuredOutput.json_schema({"type": "number", "maximum": float("nan")})


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(tiny_llama_dir)


def test_cache_is_keyed_by_spec_hash_and_bounded(tokenizer):
    pool = CompilePool(GrammarCompiler(tokenizer, tokenizer.vocab_size).compile, cache_size=2, max_per_tenant=8)
    specs = [StructuredOutput.json_schema({**OBJ, "title": str(i)}) for i in range(3)]
    first = pool.submit(specs[0])
    assert pool.submit(StructuredOutput.json_schema({**OBJ, "title": "0"})) is first
    assert pool.submit(StructuredOutput.json_schema({**OBJ, "title": "0"}, strict=True)) is not first
    assert (pool.hits, pool.misses) == (1, 2)
    pool.submit(specs[1])
    pool.submit(specs[2])  # three distinct specs since specs[0]: it was evicted
    assert pool.submit(specs[0]) is not first
    assert (pool.hits, pool.misses) == (1, 5)
    pool.close()


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("schema,cap", [
    ({"type": "object", "properties": {"a": {"type": "string", "description": "x" * caps.MAX_SCHEMA_BYTES}}},
     "max_schema_bytes"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(caps.MAX_SCHEMA_PROPERTIES + 1)}},
     "max_schema_properties"),
    (_nested(caps.MAX_SCHEMA_DEPTH + 1), "max_schema_depth"),
    ({"anyOf": [{"enum": list(range(600))}, {"enum": list(range(401))}]}, "max_schema_enum_values"),
    ({"type": "string", "pattern": "a{3000}"}, "max_schema_pattern_repeat"),
    ({"type": "string", "pattern": "a" * (caps.MAX_SCHEMA_PATTERN_CHARS + 1)}, "max_schema_pattern_chars"),
])
def test_schemas_over_a_cap_are_refused_naming_it(schema, cap):
    with pytest.raises(SchemaTooLargeError, match=cap) as err:
        StructuredOutput.json_schema(schema)
    assert err.value.cap_name == cap and str(err.value.cap) in str(err.value)
    assert isinstance(err.value, InvalidRequestError)  # the API answers 400


def test_schemas_at_the_caps_are_accepted():
    StructuredOutput.json_schema(_nested(caps.MAX_SCHEMA_DEPTH))
    StructuredOutput.json_schema({"type": "string", "pattern": "a{%d}" % caps.MAX_PATTERN_REPEAT})
    StructuredOutput.json_schema({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(caps.MAX_SCHEMA_PROPERTIES)}})


def test_tool_caps_count_every_function_together():
    def tool(i: int, props: int) -> dict:
        return {"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(props)}}}}
    half = caps.MAX_SCHEMA_PROPERTIES // 2 + 1
    with pytest.raises(SchemaTooLargeError, match="max_schema_properties"):
        StructuredOutput.tool_call([tool(0, half), tool(1, half)])
    with pytest.raises(SchemaTooLargeError, match="max_tools"):
        StructuredOutput.tool_call([tool(i, 0) for i in range(caps.MAX_TOOLS + 1)])


def test_bitmask_rows_only_for_rows_with_a_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammar = RequestGrammar(compiler.compile(StructuredOutput.json_schema(OBJ, strict=True)),
                             compiler.stop_token_ids)
    vocab = tokenizer.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(temperature=0), 0), SampleRow(SamplingParams(temperature=0), 0, grammar=grammar),
            SampleRow(SamplingParams(seed=3), 0)]
    processed = Sampler().process(logits, rows)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    allowed = torch.isfinite(processed[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    # Drive the matcher to the end through the sampler alone: greedy picks stay valid.
    text = []
    for i in range(40):
        tokens, _ = Sampler().sample(torch.randn(1, vocab, generator=torch.Generator().manual_seed(i)), [rows[1]])
        if tokens[0] in tokenizer.eos_token_ids:
            break
        text.append(tokens[0])
    jsonschema.validate(json.loads(tokenizer.decode(text)), OBJ)
    assert grammar.terminated
    # After the end (ignore_eos), only a stop token may follow.
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == sorted(tokenizer.eos_token_ids)
