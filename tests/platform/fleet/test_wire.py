"""The wire's JSON codec and the errors a worker's reply turns back into."""
from __future__ import annotations

import orjson
import pytest

from loraplex.adapters.errors import AdapterNotFoundError
from loraplex.engine.engine import RequestOutput
from loraplex.engine.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from loraplex.engine.request import AdapterRef, Lane, SamplingParams
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.platform.errors import ShuttingDownError, api_error
from loraplex.platform.fleet import wire
from loraplex.platform.fleet.errors import RETRYABLE, WorkerError, error_from_body


def _through_json(doc):
    return orjson.loads(orjson.dumps(doc))


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(max_tokens=7, temperature=0.0, stop=("x", "yz"), stop_token_ids=(2, 3), logit_bias={5: -1.5},
                   logprobs=3, min_tokens=2, seed=11, top_k=4, top_p=0.9, presence_penalty=0.5, min_p=0.1),
    SamplingParams(structured_output=StructuredOutput("json_schema", '{"type":"object"}', True)),
])
def test_sampling_params_survive_the_wire(sampling):
    assert wire.sampling_from_json(_through_json(wire.sampling_to_json(sampling))) == sampling


@pytest.mark.parametrize("doc, problem", [
    ([], "must be an object"),
    ({"max_tokens": 3, "beam_width": 2}, "beam_width"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"structured_output": "json"}, "structured_output"),
])
def test_bad_sampling_is_named(doc, problem):
    with pytest.raises(InvalidRequestError, match=problem):
        wire.sampling_from_json(doc)


def test_generate_body_names_lane_and_adapter_version():
    body = _through_json(wire.generate_body("r1", [1, 2], SamplingParams(max_tokens=2), Lane.BATCH,
                                            AdapterRef("pirate", "sha256:" + "a" * 64), "tenant-3", "tenant-3"))
    assert body["lane"] == "batch" and body["adapter"] == {"name": "pirate", "digest": "sha256:" + "a" * 64}
    assert body["prompt_token_ids"] == [1, 2] and body["cache_salt"] == "tenant-3"


def test_outputs_survive_the_wire():
    out = RequestOutput("r1", [5, 6], "hi", True, "stop", num_prompt_tokens=4, num_cached_tokens=2,
                        num_output_tokens=9, logprobs=[(-0.5, [(5, -0.5), (7, -1.0)])], stop_reason="\n")
    doc = _through_json(wire.output_to_json(out))
    assert doc["type"] == "output"
    assert wire.output_from_json(doc, "r1") == out


@pytest.mark.parametrize("cls, status", [(InvalidRequestError, 400), (PromptTooLongError, 413),
                                         (EngineOverloadedError, 503), (ShuttingDownError, 503),
                                         (AdapterNotFoundError, 404)])
def test_worker_errors_become_the_class_the_worker_raised(cls, status):
    err = error_from_body({"error": {"type": cls.__name__, "message": "m"}}, 400)
    assert type(err) is cls and api_error(err).status == status


@pytest.mark.parametrize("body", [None, {"error": {"type": "KeyError", "message": "/secret/path"}},
                                  {"error": {"type": "BlobStoreError", "message": "s3 creds"}}, {"detail": "x"}])
def test_unknown_worker_errors_are_generic_and_echo_nothing(body):
    err = error_from_body(body, 500)
    assert isinstance(err, WorkerError) and isinstance(err, RETRYABLE)
    api = api_error(err)
    assert api.status == 503 and "secret" not in api.message and "s3" not in api.message
