"""The listener's pure parts: which peers count as trusted proxies (exempt from the
per-address connection cap), and the limits' validation. The protocol itself is
exercised over real sockets in tests/e2e/isolation/ and tests/e2e/resources/."""
from __future__ import annotations

import json

import pytest

from loraplex.platform.serving.listener import TrustedPeers, over_cap_response
from loraplex.platform.settings import ServerLimits


def test_trusted_peers_match_uvicorn_forms():
    peers = TrustedPeers("127.0.0.1, 10.0.0.0/8,fd00::/8,unix-proxy")
    assert "127.0.0.1" in peers and "10.9.8.7" in peers and "fd00::1" in peers and "unix-proxy" in peers
    assert "127.0.0.2" not in peers and "192.168.1.1" not in peers and "not an address" not in peers
    assert "8.8.8.8" in TrustedPeers("*") and "8.8.8.8" not in TrustedPeers("")


def test_the_over_cap_answer_is_an_openai_429_that_closes():
    head, _, body = over_cap_response(7).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 429 Too Many Requests"
    headers = dict(x.split(": ", 1) for x in lines[1:])
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert err["type"] == "rate_limit_error" and "7 connections" in err["message"]


@pytest.mark.parametrize("field", ["body_min_rate", "max_connections_per_client"])
def test_new_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: 0})
