"""OpenAI request parsing: request bodies -> GenRequest (the rendering is in render.py).

Parsing is hand-written (no pydantic) to keep per-request cost low. Every field is
honoured or refused with a 400 naming it (openai_fields.py holds the lists, and the few
harmless fields that are ignored).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.errors import InvalidRequestError, PromptTooLongError
from loraplex.engine.request import (
    MAX_REQUEST_LOGPROB_ENTRIES,
    MAX_REQUEST_OUTPUT_TOKENS,
    SamplingParams,
    check_production,
    normalize_logit_bias,
)
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.tokenizer import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

from loraplex.platform.errors import BadRequestError
from loraplex.platform.serving.openai_fields import (
    check_fields,
    choices,
    echo_and_suffix,
    logit_processors,
    response_format,
    sampling_error,
)
from loraplex.platform.serving.request_limits import parse_request_json
from loraplex.platform.serving.tools import ToolRequest, parse_tools, prepare_messages, template_supports_tools
from loraplex.platform.settings import ServerLimits

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = MAX_STOP_STRINGS
MAX_LOGPROBS = 20


@dataclass
class GenRequest:
    chat: bool
    model: str | None
    prompt: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    # Top-n logprobs to report per token (0: only the chosen token's); None: no logprobs.
    logprobs: int | None
    priority: Any = None  # the raw `priority` field; lanes are resolved by auth
    n: int = 1  # choices returned per prompt; sampling.n are generated (more with best_of)
    # completions' echo: each prompt's text, put before each of its choices' text
    echo: list[str] | None = None
    tools: ToolRequest | None = None
    # Completions may carry several prompts (`prompt` is the first); None: `prompt` alone.
    # Choices are numbered prompt-major as OpenAI does: prompt p's choice i is p * n + i.
    prompts: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.prompts is None:
            self.prompts = [self.prompt]

    @property
    def best_of(self) -> bool:
        """More choices are generated than returned: the best n are kept."""
        return self.sampling.n > self.n

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates for the whole request: prompts x n (or best_of)."""
        return len(self.prompts) * self.sampling.n

    def prompt_number(self, engine_index: int) -> int:
        """The prompt an engine choice index (p * sampling.n + i) belongs to."""
        return engine_index // self.sampling.n


def _get_num(body: dict, name: str, default: float | None, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequestError(f"{name} must be a number between {lo} and {hi}", name)
    return float(v)


def _get_int(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise BadRequestError(f"{name} must be an integer {bound}", name)
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequestError(f"{name} must be a boolean", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise BadRequestError(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise BadRequestError(f"stop: a stop string is at most {MAX_STOP_STRING_CHARS} characters", "stop")
    return tuple(s for s in stops if s)


def _check_common(body: dict, chat: bool) -> None:
    check_fields(body, chat)
    if "stream_options" in body and body["stream_options"] is not None and not body.get("stream"):
        raise BadRequestError("stream_options is only allowed when stream is true", "stream_options")


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequestError("stream_options must be an object", "stream_options")
    return get_bool(opts, "include_usage")


def _sampling(body: dict, max_tokens: int, logprobs: int | None, n: int = 1,
              structured: StructuredOutput | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    seed = _get_int(body, "seed", None, -(2**63), 2**63 - 1)
    stop_ids = body.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) for t in stop_ids):
        raise BadRequestError("stop_token_ids must be a list of integers", "stop_token_ids")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequestError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_get_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_get_num(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=_get_int(body, "top_k", 0, -1) if body.get("top_k") != -1 else 0,
            seed=None if seed is None else seed & 0x7FFF_FFFF_FFFF_FFFF,
            stop=_stop(body),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=get_bool(body, "ignore_eos"),
            logprobs=logprobs,
            min_tokens=_get_int(body, "min_tokens", 0, 0),
            n=n,
            structured_output=structured,
            prompt_logprobs=prompt_logprobs,
            **logit_processors(body),
        )
    except InvalidRequestError as exc:
        raise sampling_error(exc, body) from None


def _max_tokens(body: dict, names: tuple[str, ...], prompt_len: int, max_model_len: int,
                default: int | None, n: int = 1, logprobs: int | None = None) -> int:
    room = max_model_len - prompt_len
    if room <= 0:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens but this model's context is {max_model_len} tokens")
    for name in names:
        v = _get_int(body, name, None, 1)
        if v is not None:
            return v  # too long for the context: the engine refuses it with the full story
    # Unasked, as much as fits both the context and what one request may produce.
    per_choice = MAX_REQUEST_OUTPUT_TOKENS // n
    if logprobs is not None:
        per_choice = min(per_choice, MAX_REQUEST_LOGPROB_ENTRIES // (n * (1 + logprobs)))
    room = min(room, max(1, per_choice))
    return room if default is None else min(default, room)


def chat_prompt(body: dict, tokenizer, add_generation_prompt: bool = True) -> tuple[list[int], ToolRequest | None]:
    """A chat's prompt as the model's chat template renders it (tools included), and its
    tool request."""
    template = getattr(tokenizer, "chat_template", None)
    tools = parse_tools(body)
    tools = tools.for_template(template) if tools is not None else None
    messages, tool_defs = prepare_messages(body["messages"], tools, template_supports_tools(template))
    extra = {"tools": tool_defs} if tool_defs else {}
    if not add_generation_prompt:
        extra["add_generation_prompt"] = False
    return tokenizer.apply_chat_template(messages, **extra), tools


def parse_chat(body: dict, tokenizer, max_model_len: int) -> GenRequest:
    _check_common(body, chat=True)
    if "messages" not in body:
        raise BadRequestError("messages is required", "messages")
    prompt, tools = chat_prompt(body, tokenizer)
    structured = response_format(body)
    constraint = tools.constraint() if tools is not None else None
    if structured is not None and constraint is not None:
        raise BadRequestError("response_format cannot be combined with a required or named tool_choice",
                              "response_format")
    n, _ = choices(body, chat=True)
    logprobs = None
    if get_bool(body, "logprobs"):
        logprobs = _get_int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise BadRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(prompt), max_model_len, None,
                             n, logprobs)
    sampling = _sampling(body, max_tokens, logprobs, n, structured or constraint)
    return GenRequest(True, body.get("model"), prompt, sampling, get_bool(body, "stream"), _include_usage(body),
                      logprobs, body.get("priority"), n, tools=tools)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """A completion's `prompt` as its prompts, in order: OpenAI and vLLM accept a string,
    a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return prompt
    raise BadRequestError("prompt must be a non-empty string, a list of strings, a list of token ids, "
                          "or a list of token-id lists", "prompt")


def _prompt_ids(prompt: str | list[int], tokenizer) -> list[int]:
    """Token ids are the engine's to check against the model's vocabulary."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if not ids:
        raise BadRequestError("the prompt is empty", "prompt")
    return ids


def _echo_text(raw: str | list[int], ids: list[int], tokenizer) -> str:
    return raw if isinstance(raw, str) else tokenizer.decode(ids)


def parse_completion(body: dict, tokenizer, max_model_len: int) -> GenRequest:
    _check_common(body, chat=False)
    echo = echo_and_suffix(body)
    n, best_of = choices(body, chat=False)
    if "prompt" not in body:
        raise BadRequestError("prompt is required", "prompt")
    raw = split_prompts(body["prompt"])
    prompts = [_prompt_ids(p, tokenizer) for p in raw]
    logprobs = _get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    # best_of ranks choices by their tokens' logprobs, so the engine reports them.
    engine_logprobs = logprobs if best_of == n or logprobs is not None else 0
    # One max_tokens for every prompt: the longest prompt bounds it (and refuses a prompt
    # that leaves no room), as each prompt alone would; what the request may produce
    # counts every prompt's choices.
    sequences = best_of * len(prompts)
    max_tokens = _max_tokens(body, ("max_tokens",), max(map(len, prompts)), max_model_len,
                             COMPLETION_DEFAULT_MAX_TOKENS, sequences, engine_logprobs)
    try:
        check_production(sequences, max_tokens, engine_logprobs)
    except InvalidRequestError as exc:
        raise sampling_error(exc, body) from None
    sampling = _sampling(body, max_tokens, engine_logprobs, best_of, response_format(body),
                         logprobs if echo else None)
    echo_texts = [_echo_text(r, ids, tokenizer) for r, ids in zip(raw, prompts)] if echo else None
    return GenRequest(False, body.get("model"), prompts[0], sampling, get_bool(body, "stream"),
                      _include_usage(body), logprobs, body.get("priority"), n, echo_texts, prompts=prompts)


def check_body(body: dict, chat: bool) -> None:
    """The checks of parse_chat / parse_completion that need no tokenizer, in their order:
    what a body can be refused for before its prompt is rendered and tokenized."""
    _check_common(body, chat)
    if chat:
        if "messages" not in body:
            raise BadRequestError("messages is required", "messages")
        parse_tools(body)
    else:
        echo_and_suffix(body)
        choices(body, chat=False)
        if "prompt" not in body:
            raise BadRequestError("prompt is required", "prompt")
        split_prompts(body["prompt"])
    response_format(body)
    bias = logit_processors(body).get("logit_bias")
    if bias is not None:
        try:
            normalize_logit_bias(bias)
        except InvalidRequestError as exc:
            raise sampling_error(exc, body) from None


def screen_request(raw: bytes, limits: ServerLimits, chat: bool, max_model_len: int, max_token_chars: int) -> None:
    """Every refusal of an OpenAI request body that needs no tokenizer: its JSON and
    bounds (request_limits.parse_request_json), then its fields (`check_body`). What
    serving/parse_pool.py runs on a big body in a process of its own."""
    check_body(parse_request_json(raw, limits, chat, max_model_len, max_token_chars), chat)
