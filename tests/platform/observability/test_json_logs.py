from __future__ import annotations

import io
import logging

import orjson
import pytest

from loraplex.platform.observability.json_logs import configure_logging
from loraplex.platform.observability.request_id import bind_request_id


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_lines_carry_the_request_id_extras_and_exceptions(root_logger):
    out = io.StringIO()
    configure_logging("json", logging.DEBUG, stream=out)
    log = logging.getLogger("loraplex.test")
    log.info("outside %s", "any request")
    with bind_request_id("req-42"):
        log.warning("usage written", extra={"tenant": "acme", "tokens": 17})
        try:
            raise KeyError("boom")
        except KeyError:
            log.exception("failed")
    lines = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    assert lines[0]["message"] == "outside any request" and "request_id" not in lines[0]
    assert lines[0]["level"] == "info" and lines[0]["logger"] == "loraplex.test"
    assert lines[0]["time"].endswith("+00:00")
    assert {k: lines[1][k] for k in ("request_id", "tenant", "tokens", "level")} == \
        {"request_id": "req-42", "tenant": "acme", "tokens": 17, "level": "warning"}
    assert lines[2]["request_id"] == "req-42" and "KeyError: 'boom'" in lines[2]["exception"]


def test_text_format_and_a_bad_format(root_logger):
    out = io.StringIO()
    configure_logging("text", stream=out)
    logging.getLogger("x").info("hello")
    assert out.getvalue().rstrip().endswith("INFO x: hello")
    with pytest.raises(ValueError, match="json"):
        configure_logging("yaml")
