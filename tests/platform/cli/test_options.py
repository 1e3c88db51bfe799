"""The listener and limit flags `serve` and `gateway` share land in their Settings groups."""
from __future__ import annotations

import argparse

from loraplex.platform.cli.options import server_options, server_settings
from loraplex.platform.settings import AdminConfig, AuthConfig, Settings, UsageConfig


def _settings(*argv: str) -> Settings:
    p = argparse.ArgumentParser()
    server_options(p)
    return Settings(**server_settings(p.parse_args(list(argv))))


def test_flags_land_in_their_groups():
    s = _settings("--auth-failure-burst", "5", "--auth-failure-rate", "0.5", "--max-upload-size", "2MiB",
                  "--usage-drain-timeout", "240", "--max-body-size", "1MiB", "--refusal-hold", "0.25",
                  "--send-buffer", "16KiB")
    assert (s.auth.failure_burst, s.auth.failure_rate) == (5, 0.5)
    assert s.admin.max_upload_bytes == 2 * 2**20 and s.usage.drain_seconds == 240.0
    assert s.limits.max_body_bytes == 2**20 and s.limits.refusal_hold == 0.25
    assert s.limits.send_buffer_bytes == 16 * 1024


def test_defaults_are_the_groups_defaults():
    s = _settings()
    assert s.auth == AuthConfig() and s.admin == AdminConfig() and s.usage == UsageConfig()
