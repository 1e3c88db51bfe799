from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.platform.errors import ConfigError, WeakSecretError
from loraplex.platform.settings import DEFAULT_ADAPTER_CACHE_BYTES
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
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "s3cret-of-20-chars!\n")
    WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").check()
    assert WorkerConfig("sqlite://", tmp_path, host="0.0.0.0").token == "s3cret-of-20-chars!"


def test_a_metrics_port_of_its_own_is_held_to_the_same_rule(monkeypatch, tmp_path):
    """/metrics on a port of its own is still behind the token: without one it listens on
    loopback only, as the internal API does."""
    monkeypatch.delenv("LORAPLEX_INTERNAL_TOKEN", raising=False)
    WorkerConfig("sqlite://", tmp_path, metrics_port=9464).check()
    WorkerConfig("sqlite://", tmp_path, metrics_host="0.0.0.0").check()  # no metrics port: nothing listens there
    with pytest.raises(ConfigError, match="0.0.0.0 without .LORAPLEX_INTERNAL_TOKEN"):
        WorkerConfig("sqlite://", tmp_path, metrics_host="0.0.0.0", metrics_port=9464).check()
    with pytest.raises(ConfigError, match="metrics port must differ"):
        WorkerConfig("sqlite://", tmp_path, port=9464, metrics_port=9464).check()
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "s3cret-of-20-chars!")
    WorkerConfig("sqlite://", tmp_path, host="0.0.0.0", metrics_host="0.0.0.0", metrics_port=9464).check()


def test_the_metrics_port_flags():
    assert (_worker_config().metrics_host, _worker_config().metrics_port) == ("127.0.0.1", None)  # on --port
    config = _worker_config("--metrics-host", "0.0.0.0", "--metrics-port", "9464")  # as the chart passes them
    assert (config.metrics_host, config.metrics_port) == ("0.0.0.0", 9464)
    assert _worker_config("--metrics-port", "0").metrics_port is None


def test_a_short_token_is_refused_even_on_loopback(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAPLEX_INTERNAL_TOKEN", "s3cret")
    with pytest.raises(WeakSecretError, match=r"too short \(6 characters\).*at least 16"):
        WorkerConfig("sqlite://", tmp_path).check()


def _worker_config(*argv: str) -> WorkerConfig:
    from loraplex.platform.cli.main import build_parser, settings_from_args
    from loraplex.platform.cli.roles import worker_config

    args = build_parser().parse_args(["worker", "--cache-dir", "/var/cache/lpx", *argv])
    return worker_config(settings_from_args(args), args)


def test_the_adapter_cache_is_bounded_by_default_and_by_the_flag():
    assert _worker_config().cache_max_bytes == DEFAULT_ADAPTER_CACHE_BYTES == 10 * 2**30
    assert WorkerConfig("sqlite://", Path("/c")).cache_max_bytes == DEFAULT_ADAPTER_CACHE_BYTES
    assert _worker_config("--adapter-cache-size", "16Gi").cache_max_bytes == 16 * 2**30  # as the chart passes it
    assert _worker_config("--adapter-cache-size", "512MiB").cache_max_bytes == 512 * 2**20
    assert _worker_config("--adapter-cache-size", "none").cache_max_bytes is None
    for bad in ("0", "lots", "-1GiB"):
        with pytest.raises(SystemExit):
            _worker_config("--adapter-cache-size", bad)


def test_the_worker_source_honours_the_bound(tmp_path, tiny_llama_dir):
    from loraplex.adapters.blobs import CachedBlobStore
    from loraplex.adapters.sources import open_source
    from loraplex.platform.db import migrate

    url = f"sqlite:///{tmp_path / 'blobs.db'}"
    migrate(url)
    config = _worker_config("--adapter-cache-size", "3MiB")
    source = open_source(url, tiny_llama_dir, tmp_path / "cache", max_rank=8, cache_max_bytes=config.cache_max_bytes)
    try:
        assert isinstance(source.store, CachedBlobStore) and source.store.cache.max_bytes == 3 * 2**20
    finally:
        source.store.engine.dispose()
