"""Request parsing and the one error-to-HTTP mapping."""
from __future__ import annotations

import pytest

from loraplex.adapters.errors import AdapterValidationError
from loraplex.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownAdapterError,
)
from loraplex.engine.errors import StreamStalledError
from loraplex.engine.structured.compile_pool import GrammarPoolBusyError, GrammarQueueFullError, GrammarTimeoutError
from loraplex.engine.request import MAX_LOGIT_BIAS, MAX_REQUEST_LOGPROB_ENTRIES, MAX_REQUEST_OUTPUT_TOKENS
from loraplex.platform.errors import (
    AuthenticationError,
    BadRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    RateLimitedError,
    RegistryUnavailableError,
    ShuttingDownError,
    api_error,
)
from loraplex.platform.serving.protocol import parse_chat, parse_completion


class FakeTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages):
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        return [1] * sum(len(m["content"]) for m in messages)


TOK = FakeTokenizer()


def test_completion_defaults_and_fields():
    r = parse_completion({"model": "m", "prompt": "hello"}, TOK, 100)
    assert r.prompt == [104, 101, 108, 108, 111] and r.sampling.max_tokens == 16 and not r.stream
    r = parse_completion({"prompt": [5, 6], "max_tokens": 3, "temperature": 0, "top_p": 0.5, "top_k": 7,
                          "seed": 3, "stop": "x", "ignore_eos": True, "logprobs": 2, "stream": True,
                          "stream_options": {"include_usage": True}}, TOK, 100)
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos, s.logprobs) == \
        (3, 0.0, 0.5, 7, 3, ("x",), True, 2)
    assert r.stream and r.include_usage and r.logprobs == 2
    assert parse_completion({"prompt": ["one"]}, TOK, 100).prompt == [111, 110, 101]
    assert parse_completion({"prompt": "abc"}, TOK, 10).sampling.max_tokens == 7  # clamped to the room left


def test_completion_prompt_forms():
    """A string, a list of strings, token ids, a list of token-id lists: OpenAI's four forms."""
    r = parse_completion({"prompt": ["ab", "c"], "n": 2}, TOK, 100)
    assert r.prompts == [[97, 98], [99]] and r.prompt == [97, 98] and r.num_sequences == 4
    assert [r.prompt_number(i) for i in range(4)] == [0, 0, 1, 1]
    r = parse_completion({"prompt": [[5, 6, 7], [8]], "best_of": 3, "echo": True}, TOK, 100)
    assert r.prompts == [[5, 6, 7], [8]] and r.num_sequences == 6 and r.echo == ["\x05\x06\x07", "\x08"]
    assert parse_completion({"prompt": [[5, 6]]}, TOK, 100).prompts == [[5, 6]]
    # One max_tokens for every prompt: the longest prompt leaves the least room.
    assert parse_completion({"prompt": ["abcdef", "a"]}, TOK, 10).sampling.max_tokens == 4


def test_chat_max_tokens_and_logprobs():
    msgs = [{"role": "user", "content": "abcd"}]
    r = parse_chat({"messages": msgs}, TOK, 100)
    assert r.sampling.max_tokens == 96 and r.logprobs is None
    r = parse_chat({"messages": msgs, "max_tokens": 5, "max_completion_tokens": 3, "logprobs": True,
                    "top_logprobs": 4, "stop": ["a", "b"]}, TOK, 100)
    assert r.sampling.max_tokens == 3 and r.logprobs == 4 and r.sampling.stop == ("a", "b")
    assert parse_chat({"messages": msgs, "logprobs": True}, TOK, 100).logprobs == 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 65}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "tools": []}, "tools"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "x", "stop": "a" * 257}, "stop"),
    ({"prompt": "x", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({}, "prompt"),
])
def test_completion_bad_requests(body, param):
    with pytest.raises(BadRequestError) as e:
        parse_completion(body, TOK, 100)
    assert e.value.param == param
    assert api_error(e.value).status == 400


def test_chat_bad_requests():
    with pytest.raises(BadRequestError):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, TOK, 100)
    with pytest.raises(BadRequestError):
        parse_chat({}, TOK, 100)
    with pytest.raises(InvalidRequestError):
        parse_chat({"messages": []}, TOK, 100)


def test_prompt_filling_the_context_is_413():
    with pytest.raises(PromptTooLongError) as e:
        parse_completion({"prompt": "x" * 10}, TOK, 10)
    assert api_error(e.value).status == 413


@pytest.mark.parametrize("exc, status, code", [
    (BadRequestError("x"), 400, None),
    (InvalidRequestError("x"), 400, None),
    (AdapterValidationError("bad rank"), 400, None),
    (AuthenticationError("x"), 401, "invalid_api_key"),
    (PermissionDeniedError("x"), 403, "permission_denied"),
    (ModelNotFoundError("m"), 404, "model_not_found"),
    (UnknownAdapterError("adapter 'secret' is not registered"), 404, "model_not_found"),
    (PromptTooLongError("x"), 413, "context_length_exceeded"),
    (RateLimitedError("slow down", retry_after=7.2), 429, "rate_limit_exceeded"),
    (EngineOverloadedError("x"), 503, "overloaded"),
    (EngineDeadError("x"), 503, "unavailable"),
    (ShuttingDownError("x"), 503, "unavailable"),
    (RuntimeError("secret internals"), 500, "internal_error"),
    (GrammarTimeoutError("x"), 400, "grammar_compile_timeout"),
    (GrammarQueueFullError("x"), 429, "grammar_compile_queue_full"),
    (GrammarPoolBusyError("x"), 503, "overloaded"),
    (StreamStalledError("x"), 408, "stream_stalled"),
    (RegistryUnavailableError("x"), 503, "adapter_registry_unavailable"),
])
def test_error_mapping(exc, status, code):
    err = api_error(exc)
    assert err.status == status and err.code == code
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert "secret" not in body["message"]
    if code == "rate_limit_exceeded":
        assert err.headers["Retry-After"] == "7"
    if code == "overloaded":
        assert "Retry-After" in err.headers


@pytest.mark.parametrize("bad", ["²", "٣", "9" * 5000, 10**5000, -1, 3.5, [], {}],
                         ids=["superscript", "arabic-digit", "5000-digit-string", "5000-digit-int", "negative",
                              "float", "list", "object"])
def test_malformed_lanes_name_their_field(bad):
    from loraplex.platform.serving.gateway import Gateway

    with pytest.raises(BadRequestError) as e:
        Gateway.requested_lane(None, bad)
    assert e.value.param == "priority"
    if isinstance(bad, str):
        with pytest.raises(BadRequestError) as e:
            Gateway.requested_lane(bad, None)
        assert e.value.param == "x-loraplex-lane"


@pytest.mark.parametrize("extra,param,cap", [
    ({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", "max_logit_bias_entries"),
    ({"n": 64, "max_tokens": 8000}, "max_tokens", "max_request_output_tokens"),
    ({"max_tokens": 8000, "logprobs": True, "top_logprobs": 20}, "max_tokens", "max_request_logprob_entries"),
])
def test_what_one_request_may_cost_is_capped_naming_the_cap(extra, param, cap):
    with pytest.raises(BadRequestError, match=cap) as err:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **extra}, TOK, 100_000)
    assert err.value.param == param


def test_caps_allow_what_fits_and_bound_the_default_max_tokens():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = parse_chat({**body, "logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS)}}, TOK, 100_000)
    assert len(r.sampling.logit_bias) == MAX_LOGIT_BIAS
    r = parse_chat({**body, "n": 64}, TOK, 100_000)  # no max_tokens: the default fits the cap
    assert r.sampling.max_tokens * 64 <= MAX_REQUEST_OUTPUT_TOKENS
    r = parse_chat({**body, "n": 2, "logprobs": True, "top_logprobs": 20}, TOK, 100_000)
    assert r.sampling.max_tokens * 2 * 21 <= MAX_REQUEST_LOGPROB_ENTRIES
    r = parse_completion({"prompt": "x", "best_of": 4, "max_tokens": MAX_REQUEST_OUTPUT_TOKENS // 4}, TOK, 100_000)
    assert r.sampling.n == 4


def test_a_prompt_list_counts_every_prompts_choices_against_the_cap():
    per_prompt = MAX_REQUEST_OUTPUT_TOKENS // 4
    r = parse_completion({"prompt": ["a", "b"], "n": 2, "max_tokens": per_prompt}, TOK, 100_000)
    assert len(r.prompts) == 2 and r.sampling.max_tokens == per_prompt
    with pytest.raises(BadRequestError, match="over the cap of 32768 output tokens") as err:
        parse_completion({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": per_prompt}, TOK, 100_000)
    assert err.value.param == "max_tokens"
    r = parse_completion({"prompt": [[1, 2]] * 8, "n": 4}, TOK, 100_000)  # unset: the default fits all 32
    assert r.sampling.max_tokens * 32 <= MAX_REQUEST_OUTPUT_TOKENS
