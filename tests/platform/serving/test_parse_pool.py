"""The parse pool: big bodies screened in a child process, refused with the error the
in-process checks give; small ones never leave; a failing child fails no request."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from loraplex.engine.errors import PromptTooLongError
from loraplex.platform.errors import BadRequestError, RateLimitedError
from loraplex.platform.serving.parse_pool import ParsePool
from loraplex.platform.serving.protocol import check_body, screen_request
from loraplex.platform.serving.request_limits import parse_request_json
from loraplex.platform.settings import ServerLimits

LIMITS = ServerLimits()
SMALL = 1024


def refuse_with_pid(raw: bytes) -> None:
    """Refuses every body, naming the process that looked at it."""
    raise BadRequestError(f"pid {os.getpid()}", "body")


def refuse_with_retry(raw: bytes) -> None:
    raise RateLimitedError("slow down", retry_after=7.5)


def die(raw: bytes) -> None:
    os._exit(3)


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def pool():  # one child for the module: each spawn imports the project anew
    p = ParsePool(screen_bytes=SMALL)
    yield p
    p.close()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _schema(props: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "string", "description": "x" * 60}
                                             for i in range(props)}}


def test_a_big_body_is_screened_in_another_process(pool):
    with pytest.raises(BadRequestError) as err:
        _run(pool.screen(b"x" * SMALL, refuse_with_pid))
    assert err.value.param == "body"
    assert str(err.value).startswith("pid ") and str(err.value) != f"pid {os.getpid()}"


def test_a_small_body_is_not_screened(pool):
    before = pool.screened.copy()
    _run(pool.screen(b"x" * (SMALL - 1), refuse_with_pid))  # would raise, had it been screened
    assert pool.screened == before


def test_parse_screens_a_big_body_then_parses_it_here(pool):
    raw = _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x" * 2000}}])
    before = pool.screened.copy()
    with pytest.raises(BadRequestError, match="parameters"):
        _run(pool.parse(raw, parse_request_json, LIMITS, True, 2048, 16, screen_with=screen_request))
    assert pool.screened["refused"] == before["refused"] + 1  # the child refused it, not the parse here
    ok = _chat(padding="y" * SMALL)  # parse_request_json alone does not look at fields
    assert _run(pool.parse(ok, parse_request_json, LIMITS, True, 2048, 16))["padding"] == "y" * SMALL
    assert pool.screened["passed"] == before["passed"] + 1


def test_the_error_keeps_its_attributes(pool):
    with pytest.raises(RateLimitedError) as err:
        _run(pool.screen(b"x" * SMALL, refuse_with_retry))
    assert err.value.retry_after == 7.5 and str(err.value) == "slow down"


@pytest.mark.parametrize("fields,kind,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(2000)}}},
     BadRequestError, "response_format"),  # over the schema size cap
    ({"logit_bias": {str(i): 1 for i in range(20000)}}, BadRequestError, "logit_bias"),  # over the entries cap
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x" * 2000}}]}, BadRequestError,
     "tools"),
    ({"bogus_field": "x" * 2000}, BadRequestError, "bogus_field"),
])
def test_request_refusals_match_the_in_process_checks(pool, fields, kind, param):
    raw = _chat(**fields)
    with pytest.raises(kind) as here:
        check_body(parse_request_json(raw, LIMITS, True, 2048, 16), True)
    with pytest.raises(kind) as there:
        _run(pool.screen(raw, screen_request, LIMITS, True, 2048, 16))
    assert str(there.value) == str(here.value) and there.value.param == here.value.param == param


def test_a_prompt_over_the_context_is_refused_by_the_screen(pool):
    raw = json.dumps({"model": "m", "prompt": "word " * 50_000}).encode()
    with pytest.raises(PromptTooLongError, match="characters"):
        _run(pool.screen(raw, screen_request, LIMITS, False, 2048, 16))


def test_a_valid_big_body_passes(pool):
    raw = _chat(tools=[{"type": "function", "function": {"name": f"t{i}", "description": "d" * 100}}
                       for i in range(50)])
    assert len(raw) >= SMALL
    _run(pool.screen(raw, screen_request, LIMITS, True, 8192, 16))


def test_a_child_that_dies_fails_no_request_and_is_replaced(pool):
    failed = pool.screened["failed"]
    _run(pool.screen(b"x" * SMALL, die))  # parsed here instead: no error
    assert pool.screened["failed"] == failed + 1
    with pytest.raises(BadRequestError):
        _run(pool.screen(b"x" * SMALL, refuse_with_pid))
