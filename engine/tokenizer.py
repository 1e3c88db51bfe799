"""Tokenizer wrapper, streaming detokenization and stop-string handling.

Streaming text must never show half a character: byte-level BPE splits emoji, CJK and
accented letters across tokens, so text is released only once it decodes cleanly.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checkpoint import ModelArch
from .errors import InvalidRequestError, ModelLoadError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
# Keys besides role/content that chat templates commonly read (tool calling).
_PASSTHROUGH_KEYS = ("name", "tool_calls", "tool_call_id")
# Prompt tokens decoded before the first output token, so a decoder that treats a
# sequence's first token specially (leading-space stripping) sees it mid-sequence.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """A model folder's Hugging Face tokenizer, returning plain token-id lists."""

    def __init__(self, model_dir: str | Path, arch: ModelArch | None = None) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            self._hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:  # transformers raises many types for a broken folder
            raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
        if arch is None and (model_dir / "config.json").is_file():
            arch = ModelArch.from_dir(model_dir)
        eos = [] if self._hf.eos_token_id is None else [int(self._hf.eos_token_id)]
        for token_id in arch.eos_token_ids if arch else ():
            if token_id not in eos:
                eos.append(token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.bos_token_id: int | None = self._hf.bos_token_id
        # Computed once: transformers rebuilds this set on every property access.
        self.special_ids: frozenset[int] = frozenset(int(i) for i in self._hf.all_special_ids)
        self.vocab_size: int = len(self._hf)

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer (for the reference implementation in tests)."""
        return self._hf

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters a vocabulary entry spells (one character per byte for
        byte-level BPE): what bounds, from the text's length alone, how few tokens a text
        can become."""
        return max((len(t) for t in self._hf.get_vocab()), default=1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Skipping by our own special-id set (not the backend's) keeps decode() and the
        # incremental detokenizer in exact agreement; no cleanup, it eats real spaces.
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = True) -> list[str]:
        """Vocabulary strings; ids the tokenizer does not know (model vocab padding) are dropped."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        tokens = self._hf.convert_ids_to_tokens(list(ids))
        return [t for t in tokens if t is not None]

    def tokens_to_string(self, tokens: list[str]) -> str:
        return self._hf.convert_tokens_to_string(tokens) if tokens else ""

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Render a chat with the model's template and tokenize it; `tools` (OpenAI
        function definitions) go to templates that render them."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain completion prompt instead")
        normalized = [_normalize_message(m, i) for i, m in enumerate(_check_list(messages))]
        try:
            text = self._hf.apply_chat_template(
                normalized, add_generation_prompt=add_generation_prompt, tokenize=False,
                **({"tools": tools} if tools else {}))
        except Exception as exc:  # templates raise jinja errors for conversations they reject
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
        # The template already wrote any BOS it wants; adding special tokens would double it.
        return self.encode(text, add_special_tokens=False)


def _check_list(messages: Any) -> list:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    return messages


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                                  f"got {str(role)[:40]!r}")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""  # an assistant turn that only calls tools
    out: dict[str, Any] = {"role": role, "content": _content_text(content, where)}
    out.update({k: message[k] for k in _PASSTHROUGH_KEYS if k in message})
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequestError(f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}}")
        texts.append(part["text"])
    # OpenAI-style parts are separate blocks of one message; a newline keeps words apart.
    return "\n".join(texts)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, never splitting a character.

    Keeps two offsets into a short token window: text up to `read_offset` was already
    emitted; `prefix_offset` marks a little context before it, decoded again so tokens
    whose rendering depends on their neighbours (leading spaces, byte fragments) come out
    as they would in the full decode. Each step decodes only that window.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._tokens = tokenizer.ids_to_tokens(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens)
        self._prefix_text: str | None = tokenizer.tokens_to_string(self._tokens)
        if self._prefix_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: its bytes would merge with the output's.
            self._tokens, self._prefix_text = [], ""
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Text finalized by these tokens ("" while a character is still incomplete)."""
        self._tokens.extend(self._tok.ids_to_tokens(new_token_ids, self._skip))
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character, as U+FFFD) when generation ends."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._tok.tokens_to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._tok.tokens_to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Drop tokens before the new prefix so the window (and memory) stays bounded.
        self._tokens = self._tokens[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        self._prefix_text = None
        return delta


# Stop conditions are checked on the engine thread for every token of every request, so
# their number and length are capped (OpenAI itself takes at most 4 stop strings).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def check_stop_limits(stop: Sequence[str], stop_token_ids: Sequence[int] = ()) -> None:
    """Raise InvalidRequestError when the stop conditions exceed the documented caps."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(f"stop: a stop string is at most {MAX_STOP_STRING_CHARS} characters, "
                                      f"got one of {len(s)}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")


class _StopMatcher:
    """Knuth-Morris-Pratt automaton of one stop string: constant amortized work per character."""

    __slots__ = ("text", "_fail", "state")

    def __init__(self, text: str) -> None:
        self.text = text
        fail = [0] * len(text)
        k = 0
        for i in range(1, len(text)):
            while k and text[i] != text[k]:
                k = fail[k - 1]
            if text[i] == text[k]:
                k += 1
            fail[i] = k
        self._fail = fail
        self.state = 0  # length of the longest prefix of `text` the stream ends with

    def step(self, ch: str) -> bool:
        """Advance by one character; True when the stop string has just been completed."""
        text, k = self.text, self.state
        while k and ch != text[k]:
            k = self._fail[k - 1]
        if ch == text[k]:
            k += 1
        if k == len(text):
            self.state = self._fail[k - 1]
            return True
        self.state = k
        return False


class StopChecker:
    """Cuts streamed text at the first stop string to end, holding back possible stop prefixes.

    Each character is examined once per stop string (no rescans that grow with the output
    or the held-back text). When several stop strings end at the same character, the
    longest one (the earliest to start) is the match.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        stops = tuple(s for s in dict.fromkeys(stop) if s)
        check_stop_limits(stops)
        self._matchers = [_StopMatcher(s) for s in stops]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string ended the output)."""
        if self.stopped:
            return "", True
        if not self._matchers:
            return delta, False
        text = self._held + delta
        base = len(self._held)
        for i, ch in enumerate(delta):
            done = [m.text for m in self._matchers if m.step(ch)]
            if done:
                self.matched = max(done, key=len)
                self.stopped, self._held = True, ""
                return text[: base + i + 1 - len(self.matched)], True
        keep = max(m.state for m in self._matchers)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Held-back text, when generation ended for another reason (EOS, max_tokens)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
