"""The worker wire's codec: what one side writes, the other reads back the same; bad
input is refused by name; errors cross as their class names, internals never."""
from __future__ import annotations

import dataclasses

import pytest

from loraplex.adapters.errors import AdapterNotFoundError, BlobStoreError
from loraplex.engine.output import RequestOutput
from loraplex.engine.errors import (EngineOverloadedError, InvalidRequestError, PromptTooLongError,
                                    TenantShareExceededError)
from loraplex.engine.mixtures import mixture_ref
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.structured.compile_pool import GrammarQueueFullError, GrammarShareBusyError
from loraplex.platform.errors import ShuttingDownError, api_error
from loraplex.platform.routing import prefix_key
from loraplex.platform.fleet.errors import WorkerError, decode_error, error_from_body, error_status
from loraplex.platform.fleet.wire import (
    GenerateRequest,
    adapter_from_json,
    coalesce,
    output_from_json,
    output_to_json,
    sampling_from_json,
    sampling_to_json,
)


def test_generate_request_round_trip():
    sp = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=9, stop=("x", "y"), stop_token_ids=(2,),
                        logprobs=2, logit_bias={5: -1.5}, structured_output=StructuredOutput.json_schema(
                            {"type": "object", "properties": {"a": {"type": "integer"}}}))
    req = GenerateRequest("r1", [1, 2, 3], sp, Lane.BATCH, AdapterRef("ad", "sha256:" + "a" * 64), "salt", "acme")
    assert GenerateRequest.from_json(req.to_json()) == req
    assert sampling_from_json({}) == SamplingParams()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "g"}}]
    for so in (StructuredOutput.tool_call(tools, "required", True), StructuredOutput.json_object(),
               StructuredOutput.tool_call(tools, {"type": "function", "function": {"name": "g"}})):
        sp = SamplingParams(structured_output=so)
        assert sampling_from_json(sampling_to_json(sp)) == sp
    assert sampling_from_json(sampling_to_json(SamplingParams())) == SamplingParams()


def test_the_prefix_key_is_the_adapter_versions_on_both_sides_of_the_wire():
    """The gateway routes by the key it computes; the worker reports the key of what it
    served: both from the adapter's digest, as the KV cache keys it, never its name."""
    ids = list(range(100, 180))
    v1 = AdapterRef("sql", "sha256:" + "a" * 64)
    sent = GenerateRequest("r1", ids, SamplingParams(), adapter=v1, cache_salt="tenant-1")
    read = GenerateRequest.from_json(sent.to_json())  # what the worker sees
    assert read.prefix_key == sent.prefix_key == prefix_key("tenant-1", v1.digest, ids) is not None
    renamed = dataclasses.replace(sent, adapter=AdapterRef("sql-prod", v1.digest))
    assert renamed.prefix_key == sent.prefix_key  # same weights under another name: same cached KV
    rebound = dataclasses.replace(sent, adapter=AdapterRef("sql", "sha256:" + "b" * 64))
    assert rebound.prefix_key != sent.prefix_key  # the name now means other weights
    assert dataclasses.replace(sent, adapter=None).prefix_key not in (None, sent.prefix_key)
    assert dataclasses.replace(sent, prompt_token_ids=ids[:15]).prefix_key is None  # no full block


def test_a_mixture_crosses_with_its_components_and_is_checked():
    a, b = AdapterRef("a", "sha256:" + "a" * 64), AdapterRef("b", "sha256:" + "b" * 64)
    mix = mixture_ref([(a, 0.7), (b, -0.3)])
    sent = GenerateRequest("r1", [1, 2, 3], SamplingParams(), adapter=mix)
    doc = sent.to_json()
    assert [c["weight"] for c in doc["adapter"]["mixture"]] == [0.7, -0.3]
    assert GenerateRequest.from_json(doc).adapter == mix
    forged = {**doc["adapter"], "digest": a.digest}  # a mixture's identity is its components'
    with pytest.raises(InvalidRequestError, match="its components make"):
        adapter_from_json(forged)
    for bad in ([], [{"name": "a", "digest": a.digest}], [{"name": "a", "digest": a.digest, "weight": 0}],
                [{"name": "a", "digest": a.digest, "weight": 1, "extra": 1}]):
        with pytest.raises(InvalidRequestError):
            adapter_from_json({**doc["adapter"], "mixture": bad})


@pytest.mark.parametrize("sampling, field", [
    ({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"top_p": "1"}, "top_p"),
    ({"seed": "7"}, "seed"), ({"ignore_eos": 1}, "ignore_eos"), ({"stop": "x"}, "stop"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"structured_output": {"kind": "regex"}}, "structured_output"), ({"best_of": 2}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"), ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
    ({"structured_output": {"kind": "tool_call", "spec": "garbage", "strict": True}}, "spec"),
    ({"structured_output": {"kind": "tool_call", "spec": '{"functions": [1], "parallel": true}', "strict": True}},
     "tools"),
    ({"structured_output": {"kind": "json_schema", "spec": '{"type": "object", "not": {}}'}}, "not"),
])
def test_bad_sampling_is_refused_by_name(sampling, field):
    with pytest.raises(InvalidRequestError, match=field):
        sampling_from_json(sampling)


def test_outputs_round_trip_and_coalesce():
    a = RequestOutput("r", [5], "he", False, num_prompt_tokens=3, num_output_tokens=1, logprobs=[(-0.5, [(5, -0.5)])])
    b = RequestOutput("r", [6, 7], "llo", True, "stop", 3, 2, 3, [(-0.1, [(6, -0.1)]), (-0.2, [(7, -0.2)])], "o")
    assert output_from_json("r", output_to_json(b)) == b
    joined = coalesce([a, b])
    assert (joined.new_token_ids, joined.new_text, joined.finished, joined.finish_reason) == ([5, 6, 7], "hello",
                                                                                             True, "stop")
    assert joined.logprobs == a.logprobs + b.logprobs and joined.num_output_tokens == 3


@pytest.mark.parametrize("exc, status", [
    (InvalidRequestError("bad"), 400), (PromptTooLongError("long"), 413), (AdapterNotFoundError("gone"), 404),
    (EngineOverloadedError("busy"), 503), (ShuttingDownError("draining"), 503)])
def test_domain_errors_cross_by_class_name(exc, status):
    got_status, body = error_status(exc)
    assert got_status == status and body["error"]["type"] == type(exc).__name__
    back = decode_error(body)
    assert type(back) is type(exc) and str(back) == str(exc)


def test_internal_errors_are_not_echoed():
    status, body = error_status(KeyError("/secret/path"))
    assert status == 500 and "secret" not in str(body) and body["error"]["type"] == "WorkerError"
    status, body = error_status(BlobStoreError("postgresql://user:pw@db failed"))
    assert status == 503 and "pw" not in str(body)
    assert isinstance(decode_error({"error": {"type": "NoSuchError", "message": "m"}}), WorkerError)
    assert isinstance(decode_error({"nope": 1}), WorkerError)


def test_tenant_weight_timeout_and_engine_times_cross_the_wire():
    req = GenerateRequest("r2", [1, 2], SamplingParams(), Lane.STANDARD, None, "salt", "7", 2.5, 30.0)
    assert GenerateRequest.from_json(req.to_json()) == req
    assert GenerateRequest.from_json({"request_id": "r3", "prompt_token_ids": [1]}).tenant_weight == 1.0
    for bad in ({"tenant_weight": 0}, {"tenant_weight": "2"}, {"timeout": -1}, {"timeout": float("inf")}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            GenerateRequest.from_json({"request_id": "r", "prompt_token_ids": [1], **bad})
    out = RequestOutput("r", [5], "x", False, num_prompt_tokens=3, num_output_tokens=1, queue_time=0.25,
                        prefill_time=0.5)
    assert output_from_json("r", output_to_json(out)) == out


def test_a_tenant_over_its_share_crosses_as_a_429_with_its_message():
    from loraplex.engine.errors import TenantShareExceededError
    from loraplex.platform.errors import api_error

    status, body = error_status(TenantShareExceededError("7", 3, 3))
    assert status == 429 and body["error"]["type"] == "TenantShareExceededError"
    back = decode_error(body)
    assert isinstance(back, TenantShareExceededError) and "its share of the queue is 3" in str(back)
    err = api_error(back)  # what the gateway answers its client
    assert (err.status, err.code) == (429, "tenant_queue_share_exceeded")


def test_a_tenants_own_flood_reaches_its_client_as_429_through_the_gateway():
    """What the gateway answers (error_from_body): the tenant's 429 with its code, not a
    worker failure's 503."""
    for exc, code in ((TenantShareExceededError("7", 3, 3), "tenant_queue_share_exceeded"),
                      (GrammarQueueFullError("tenant 'a' already has 4 schema compiles"), "grammar_compile_queue_full"),
                      (GrammarShareBusyError("tenant 'a' compiles one schema at a time"), "grammar_compile_share_busy")):
        status, body = error_status(exc)
        back = error_from_body(body, status)
        assert type(back) is type(exc) and str(exc) in str(back)
        err = api_error(back)
        assert (err.status, err.code) == (429, code)


def test_prefill_progress_and_engine_times_survive_the_wire_and_coalescing():
    # A token-less prefill-progress output is what bills a client that leaves mid-prefill.
    progress = RequestOutput("r", [], "", False, num_prompt_tokens=40, num_processed_prompt_tokens=16)
    assert output_from_json("r", output_to_json(progress)) == progress
    first = RequestOutput("r", [5], "a", False, num_prompt_tokens=40, num_output_tokens=1,
                          num_processed_prompt_tokens=40, queue_time=0.25, prefill_time=0.5)
    second = RequestOutput("r", [6], "b", False, num_prompt_tokens=40, num_output_tokens=2,
                           num_processed_prompt_tokens=40)
    joined = coalesce([first, second])
    assert (joined.queue_time, joined.prefill_time, joined.num_processed_prompt_tokens) == (0.25, 0.5, 40)
