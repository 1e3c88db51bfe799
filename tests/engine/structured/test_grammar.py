"""Specs, the unsupported-feature check, the compiled-grammar cache and compilation off
the engine thread."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.request import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.structured import StructuredOutput, UnsupportedSchemaError
from loraplex.engine.structured.grammar import GrammarCache, StructuredConfig
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


def test_cache_is_keyed_by_spec_and_bounded(tokenizer):
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, StructuredConfig(cache_size=2))
    specs = [StructuredOutput.json_schema({**OBJ, "title": str(i)}) for i in range(3)]
    first = cache.compiled(specs[0])
    assert cache.compiled(StructuredOutput.json_schema({**OBJ, "title": "0"})) is first
    assert cache.compiled(StructuredOutput.json_schema({**OBJ, "title": "0"}, strict=True)) is not first
    assert (cache.hits, cache.misses) == (1, 2)
    cache.compiled(specs[1])
    cache.compiled(specs[2])  # three distinct specs since specs[0]: it was evicted
    assert cache.compiled(specs[0]) is not first
    assert (cache.hits, cache.misses) == (1, 5)
    cache.close()


def test_compilation_runs_off_the_caller_thread(tokenizer):
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    pool.submit(gate.wait)  # the only worker is busy: compilation must queue, not block us
    cache = GrammarCache(tokenizer, tokenizer.vocab_size, executor=pool)
    grammar = cache.request(StructuredOutput.json_schema(OBJ))
    assert not grammar.ready() and not grammar.future.done()
    gate.set()
    grammar.future.result(timeout=60)
    assert grammar.ready()
    pool.shutdown()


def test_bitmask_rows_only_for_rows_with_a_grammar(tokenizer):
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    grammar = cache.request(StructuredOutput.json_schema(OBJ, strict=True))
    grammar.future.result(timeout=60)
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
    cache.close()


def test_a_failed_compilation_ends_the_request_instead_of_the_step(tokenizer):
    from concurrent.futures import Future

    from loraplex.engine.structured.grammar import RequestGrammar

    fut: Future = Future()
    fut.set_exception(MemoryError("out of memory while compiling"))
    grammar = RequestGrammar(fut, tokenizer.eos_token_ids)
    assert grammar.ready() and grammar.terminated
    row = SampleRow(SamplingParams(temperature=0.7, seed=1), 0, grammar=grammar)
    tokens, _ = Sampler().sample(torch.randn(1, tokenizer.vocab_size), [row])
    assert tokens[0] in tokenizer.eos_token_ids and isinstance(grammar.error, MemoryError)
