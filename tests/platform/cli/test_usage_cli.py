"""`loraplex tenant create|update|show` quotas and `loraplex usage export|show`, on SQLite
and PostgreSQL: output, files, and one-line errors (never a traceback)."""
from __future__ import annotations

import csv
import io
import json

import pytest
from loraplex.platform.db.database import Database, make_db_engine
from loraplex.platform.metering.writer import Event, EventStore
from loraplex.platform.quotas.limits import Limits, get_quota

T0 = 1_768_435_200.0  # 2026-01-15T00:00:00Z (in the past: its periods are over)




def test_tenant_quotas(cli):
    code, out, _ = cli("tenant", "create", "acme", "--rpm", "60", "--token-budget", "1_000_000")
    assert code == 0 and "rpm 60, token budget 1000000/month" in out
    db = Database(cli.url)
    try:
        code, out, _ = cli("tenant", "update", "acme", "--tpm", "5000", "--max-concurrency", "4",
                           "--budget-period", "day")
        assert code == 0 and "rpm 60, tpm 5000, max-concurrency 4, token budget 1000000/day" in out
        assert get_quota(db, "acme").limits == Limits(60, 5000, 4, 1_000_000, "day")
        assert cli("tenant", "update", "acme", "--rpm", "none")[0] == 0
        assert get_quota(db, "acme").limits.rpm is None
        code, out, _ = cli("tenant", "show", "acme")
        assert code == 0 and "tpm 5000" in out and "0 of 1000000 tokens used this day" in out
        key = cli("key", "create", "acme")[1].strip()
        code, out, _ = cli("tenant", "update", "acme", "--key", key.split("_")[1], "--rpm", "5")
        assert code == 0 and f"key lpx_{key.split('_')[1]} of tenant acme: rpm 5" in out
        assert "rpm 5" in cli("tenant", "show", "acme")[1]
        code, out, _ = cli("tenant", "update", "acme", "--clear-quotas")
        assert code == 0 and "none (unlimited)" in out and get_quota(db, "acme").limits.empty
    finally:
        db.dispose()


@pytest.mark.parametrize("argv, message", [
    (("tenant", "update", "nobody", "--rpm", "3"), "no tenant named 'nobody'"),
    (("tenant", "update", "acme"), "nothing to change"),
    (("tenant", "update", "acme", "--budget-period", "day"), "needs a token budget"),
    (("tenant", "create", "zeta", "--budget-period", "day"), "needs a token budget"),
    (("tenant", "update", "acme", "--key", "000000000000", "--rpm", "1"), "has no API key with prefix"),
    (("usage", "export", "--from", "2026-01-15", "--to", "2026-01-14"), "must be after"),
    (("usage", "export", "--from", "noon", "--to", "2026-01-16"), "--from 'noon' is not an ISO date"),
    (("usage", "export", "--from", "2026-01-15T10:30", "--to", "2026-01-16", "--granularity", "hour"),
     "not on an hour boundary"),
    (("usage", "export", "--from", "2026-01-15", "--to", "2026-01-16", "--tenant", "nobody"), "no tenant named"),
    (("usage", "show", "--from", "2026-01-15", "--to", "2026-01-16", "--tenant", "nobody"), "no tenant named"),
])
def test_errors_are_one_line(cli, argv, message):
    cli("tenant", "create", "acme")
    code, out, err = cli(*argv)
    assert code == 1 and message in err and "Traceback" not in err and err.startswith("loraplex: error: "), err


def test_bad_limit_is_a_usage_error(cli):
    code, _, err = cli("tenant", "create", "x", "--rpm", "lots")
    assert code == 2 and "not a limit: 'lots'" in err


def test_usage_export_and_show(cli, tmp_path):
    assert cli("tenant", "create", "acme")[0] == 0
    cli("tenant", "create", "beta")
    engine = make_db_engine(cli.url)
    try:
        EventStore(engine).write([Event(f"cmpl-{i}", 1 + i % 2, None, None, None, 1, "stop", 5, 0, i + 1,
                                        T0 + 60 * i, T0 + 60 * i + 0.1, T0 + 60 * i + 1) for i in range(10)])
    finally:
        engine.dispose()
    code, out, err = cli("usage", "export", "--from", "2026-01-15", "--to", "2026-01-16")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and len(rows) == 10 and "exported 10 events" in err
    code, out, _ = cli("usage", "export", "--from", "2026-01-15", "--to", "2026-01-16", "--tenant", "acme",
                       "--format", "jsonl")
    assert code == 0 and [json.loads(x)["request_id"] for x in out.splitlines()] == [f"cmpl-{i}" for i in (0, 2, 4, 6, 8)]
    dest = tmp_path / "bill.jsonl"
    code, out, err = cli("usage", "export", "--from", "2026-01-15", "--to", "2026-01-16", "--format", "cloudevents",
                         "--granularity", "day", "--output", str(dest))
    assert code == 0 and out == "" and "exported 2 daily records" in err
    ces = [json.loads(x) for x in dest.read_text().splitlines()]
    assert {c["subject"] for c in ces} == {"acme", "beta"} and {c["type"] for c in ces} == {"com.loraplex.usage.daily"}
    assert sum(c["data"]["total_tokens"] for c in ces) == sum(5 + i + 1 for i in range(10))
    code, out, _ = cli("usage", "show", "--from", "2026-01-15", "--to", "2026-01-16")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and lines[1].split()[1:3] == ["acme", "-"]
    assert lines[1].split()[3:] == ["5", "25", "0", "25", "50"]
