"""What a client learns of a worker's error body: its class when it may know it, else a 503."""
from __future__ import annotations

import pytest

from loraplex.adapters.errors import AdapterNotFoundError, BlobStoreError
from loraplex.engine.errors import EngineOverloadedError, InvalidRequestError, ModelLoadError, PromptTooLongError
from loraplex.platform.errors import AuthenticationError, ShuttingDownError, api_error
from loraplex.platform.fleet.errors import RETRYABLE, WorkerError, error_from_body
from loraplex.platform.fleet.errors import error_status


@pytest.mark.parametrize("exc, status", [(InvalidRequestError("bad"), 400), (PromptTooLongError("long"), 413),
                                         (EngineOverloadedError("busy"), 503), (ShuttingDownError("drain"), 503),
                                         (AdapterNotFoundError("no such digest"), 404)])
def test_what_a_client_may_know_keeps_its_class(exc, status):
    worker_status, body = error_status(exc)  # what the worker answers
    err = error_from_body(body, worker_status)
    assert type(err) is type(exc) and api_error(err).status == status


@pytest.mark.parametrize("exc", [BlobStoreError("s3://secret-bucket unreachable"), ModelLoadError("/models/x"),
                                 AuthenticationError("bad internal token"), KeyError("/secret/path")])
def test_everything_else_is_a_retryable_503_naming_no_internals(exc):
    status, body = error_status(exc)
    err = error_from_body(body, status)
    assert isinstance(err, WorkerError) and isinstance(err, RETRYABLE)
    api = api_error(err)
    assert api.status == 503 and "secret" not in api.message and "/models" not in api.message


@pytest.mark.parametrize("body", [None, {"detail": "x"}, {"error": "x"}, {"error": {"type": "Nope", "message": "m"}}])
def test_malformed_bodies_are_worker_errors(body):
    assert isinstance(error_from_body(body, 502), WorkerError)
