from __future__ import annotations

import pytest

from loraplex.platform.errors import ConfigError
from loraplex.platform.worker.config import WorkerConfig, is_loopback


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("10.0.0.3", False), ("worker-0.svc", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_non_loopback_worker_needs_the_token(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAPLEX_INTERNAL_TOKEN", raising=False)
    WorkerConfig("sqlite://", tmp_path).check()
    with pytest.raises(ConfigError, match="LORAPLEX_INTERNAL_TOKEN"):
        WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").check()
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "  ")  # blank is no token
    with pytest.raises(ConfigError):
        WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").check()
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "s3cret")
    WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").check()
    assert WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").token == "s3cret"
