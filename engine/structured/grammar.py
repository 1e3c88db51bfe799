"""Grammar compilation (xgrammar) off the engine thread, an LRU cache of compiled
grammars keyed by spec, and the per-request matcher the sampler masks logits with."""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
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
    cache_size: int = 256  # compiled grammars kept (LRU)
    compile_threads: int = 1
    # False: compact JSON, so a model cannot spend its whole budget on whitespace.
    any_whitespace: bool = False


class RequestGrammar:
    """One request's constraint: ready once compiled; then accepts the request's tokens
    and fills its row of the step's token bitmask."""

    def __init__(self, future: Future, stop_token_ids: tuple[int, ...]) -> None:
        self.future = future
        self._matcher: xgr.GrammarMatcher | None = None
        self._stop_ids = list(stop_token_ids)
        self.error: BaseException | None = None

    def ready(self) -> bool:
        return self.future.done()

    def _get(self) -> xgr.GrammarMatcher | None:
        if self._matcher is None and self.error is None:
            try:
                compiled = self.future.result()
            except Exception as exc:  # grammar building was checked up front; log, don't crash the step
                log.error("grammar compilation failed: %s", exc)
                self.error = exc
                return None
            self._matcher = xgr.GrammarMatcher(compiled)
        return self._matcher

    @property
    def terminated(self) -> bool:
        m = self._get()
        return m is None or m.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        m = self._get()
        if m is not None and not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, row)
            return
        # Finished (or failed): only a stop token may follow, e.g. under ignore_eos.
        bitmask[row] = 0
        for t in self._stop_ids:
            bit = 1 << (t % 32)
            bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit

    def accept(self, token: int) -> None:
        m = self._get()
        if m is not None and not m.is_terminated():
            if not m.accept_token(token):
                log.error("grammar rejected token %d that its own mask allowed", token)


class GrammarCache:
    """Builds each spec's xgrammar `Grammar` on the caller's thread (cheap, and where a
    bad schema must raise), compiles it against the tokenizer on a worker thread, and
    keeps the compiled grammars of the last `cache_size` specs."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, config: StructuredConfig | None = None,
                 executor: Executor | None = None) -> None:
        self.config = config or StructuredConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = executor or ThreadPoolExecutor(self.config.compile_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        # The tokenizer's token table is built on first use, on a worker thread too:
        # engines that never see a constraint never pay for it, and no step waits for it.
        with self._init_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer.hf, vocab_size=self._vocab_size,
                    stop_token_ids=list(self._tokenizer.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def request(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request; raises UnsupportedSchemaError for a bad spec."""
        return RequestGrammar(self.compiled(spec), self._tokenizer.eos_token_ids)

    def compiled(self, spec: StructuredOutput) -> Future:
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return fut
        grammar = self._grammar(spec)
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is None:  # not compiled by a racing caller meanwhile
                self.misses += 1
                fut = self._pool.submit(self._compile, grammar)
                fut.add_done_callback(lambda f, key=spec.key: self._forget_failed(key, f))
                self._cache[spec.key] = fut
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            return fut

    def _forget_failed(self, key: tuple, fut: Future) -> None:
        if fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
