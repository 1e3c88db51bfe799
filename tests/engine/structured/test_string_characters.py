"""Strings under a grammar are valid JSON strings: no raw control characters, bounded or not."""
from __future__ import annotations

import pytest
import xgrammar as xgr

from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.grammar import GrammarCompiler
from loraplex.engine.tokenizer import Tokenizer

TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"]}}}]


@pytest.fixture(scope="module")
def cache(smollm2_dir) -> GrammarCompiler:
    tok = Tokenizer(smollm2_dir)
    return GrammarCompiler(tok, tok.vocab_size)


@pytest.mark.parametrize("spec, prefix", [
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}},
                                   "required": ["a"]}), '{"a": "'),
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}),
     '{"a": "'),
    (StructuredOutput.tool_call(TOOL, "required"), '<tool_call>\n{"name": "f", "arguments": {"a": "'),
])
def test_raw_control_characters_are_refused(cache, spec, prefix):
    compiled = cache.compile(spec)
    ok = xgr.GrammarMatcher(compiled)
    assert ok.accept_string(prefix + 'ab"')
    for ch in ("\x00", "\x0c", "\x1f"):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(prefix + "a")
        assert not m.accept_string(ch), repr(ch)
