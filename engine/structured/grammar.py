"""Grammar building and compilation (xgrammar), and the per-request matcher the sampler
masks logits with. Compiles run in `compile_pool.CompilePool`, before a request is queued."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr
from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

from .spec import StructuredOutput, UnsupportedSchemaError

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Hermes-style calls, as the Qwen2 and SmolLM2 chat templates render and parse them.
_CALL_BEGIN = '<tool_call>\n{"name": "'
_CALL_ARGS = '", "arguments": '
_CALL_END = "}\n</tool_call>"


@dataclass(frozen=True)
class StructuredConfig:
    cache_size: int = 256  # compiled grammars kept (LRU, by spec hash)
    compile_threads: int = 2
    # Seconds a request waits for its grammar; a compile still running then is refused
    # (GrammarTimeoutError, 400) and finishes in the background, into the cache.
    compile_deadline: float = 10.0
    # Compiles one tenant may have queued or running; more are refused (429).
    max_compiles_per_tenant: int = 4
    # The compile workers' nice value (19: lowest): a compile uses only the CPU serving leaves.
    compile_nice: int = 19
    # False: compact JSON, so a model cannot spend its whole budget on whitespace.
    any_whitespace: bool = False


class RequestGrammar:
    """One request's constraint, from a grammar compiled before the request was queued:
    accepts the request's tokens and fills its row of the step's token bitmask."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: tuple[int, ...]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop_ids = list(stop_token_ids)

    def ready(self) -> bool:
        return True  # compiled before the engine saw the request

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        m = self._matcher
        if not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, row)
            return
        # Finished: only a stop token may follow, e.g. under ignore_eos.
        bitmask[row] = 0
        for t in self._stop_ids:
            bit = 1 << (t % 32)
            bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit

    def accept(self, token: int) -> None:
        m = self._matcher
        if not m.is_terminated():
            if not m.accept_token(token):
                log.error("grammar rejected token %d that its own mask allowed", token)


class GrammarCompiler:
    """Builds a spec's xgrammar `Grammar` and compiles it against the tokenizer, on the
    calling thread: a compile pool's worker (compile_pool.py), never the engine thread."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, config: StructuredConfig | None = None) -> None:
        self.config = config or StructuredConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._init_lock = threading.Lock()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokenizer.eos_token_ids)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Raises UnsupportedSchemaError for a spec the grammar builder refuses."""
        grammar = self._grammar(spec)
        # The token table is built on first use: engines that never see a constraint never pay for it.
        with self._init_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf, vocab_size=self._vocab_size,
                    stop_token_ids=list(self._tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def _grammar(self, spec: StructuredOutput) -> xgr.Grammar:
        return _no_control_characters(self._build(spec))

    def _build(self, spec: StructuredOutput) -> xgr.Grammar:
        try:
            if spec.kind == "json_object":
                return self._from_schema({"type": "object"}, strict=False)
            if spec.kind == "json_schema":
                return self._from_schema(json.loads(spec.spec), spec.strict)
            return xgr.Grammar.from_structural_tag(self._tool_call_tag(json.loads(spec.spec)))
        except RuntimeError as exc:  # xgrammar reports schema problems as RuntimeError
            raise UnsupportedSchemaError([_xgrammar_message(exc)]) from None

    def _from_schema(self, schema: Any, strict: bool) -> xgr.Grammar:
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=self.config.any_whitespace,
                                            strict_mode=strict)

    def _tool_call_tag(self, resolved: dict) -> StructuralTag:
        tags = [TagFormat(begin=_CALL_BEGIN + f["name"] + _CALL_ARGS,
                          content=JSONSchemaFormat(json_schema=f["parameters"], max_whitespace_cnt=1),
                          end=_CALL_END)
                for f in resolved["functions"]]
        return StructuralTag(format=TagsWithSeparatorFormat(
            tags=tags, separator="\n", at_least_one=True, stop_after_first=not resolved["parallel"]))


# xgrammar writes the characters of length-bounded strings as the first class below, which
# lets raw control characters through (invalid JSON: "\x0c" inside a string), while its
# unbounded strings use the second. The grammar is rebuilt from its text with the second.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _no_control_characters(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _BOUNDED_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR), root_rule_name="root")


def _xgrammar_message(exc: RuntimeError) -> str:
    # "[12:00:00] /project/cpp/json_schema_converter.cc:123: <message>" -> "<message>"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
