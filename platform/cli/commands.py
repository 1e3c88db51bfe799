"""What each `loraplex` CLI command does (argument parsing lives in cli/main.py)."""
from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import threading

from loraplex.platform.tenancy.adapter_registry import add_adapter, list_adapters, open_store, shared_blob_store
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.tenants import (
    TenantInfo,
    create_key,
    create_tenant,
    list_tenants,
    revoke_key,
    tenant_info,
    update_tenant,
)

log = logging.getLogger("loraplex")


def open_db(settings: Settings) -> Database:
    """Migrate (a no-op when current) and open the database."""
    migrate(settings.db_url)
    return Database(settings.db_url)


def _out(line: str = "") -> None:
    print(line, flush=True)


def cli_actor() -> str:
    """Who made a change from the command line, for the audit log: `cli:<user>@<host>`."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name (a container's bare uid)
        user = f"uid{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


def _audit(db: Database, action: str, target: str, **details) -> None:
    """One audit row for a change made here, as the admin API writes for its own."""
    from loraplex.platform.tenancy import audit

    with db.session() as s:
        audit.record(s, cli_actor(), action, target, **details)


def tenant_create(db: Database, name: str, lane: str, allowed: list[str] | None, quotas: dict | None = None, *,
                  weight: float = 1.0, request_timeout: float | None = None) -> int:
    from loraplex.platform.errors import BadRequestError
    from loraplex.platform.quotas.limits import set_quota

    if quotas and "budget_period" in quotas and quotas.get("token_budget") is None:
        raise BadRequestError("--budget-period needs a token budget: give --token-budget too")
    t = create_tenant(db, name, lane, allowed, weight=weight, request_timeout=request_timeout)
    _out(f"created tenant {t.name} (lane {t.default_lane}; may ask for {', '.join(t.allowed_lanes)}; "
         f"{_scheduling_text(t)})")
    if quotas:
        _out(f"quotas: {_limits_text(set_quota(db, name, **quotas).limits)}")
    _audit(db, "tenant.create", f"tenant:{t.name}", default_lane=t.default_lane, allowed_lanes=list(t.allowed_lanes),
           weight=t.weight, request_timeout=t.request_timeout, quotas=quotas or {})
    return 0


def _limits_text(limits) -> str:
    parts = [f"rpm {limits.rpm}" if limits.rpm is not None else None,
             f"tpm {limits.tpm}" if limits.tpm is not None else None,
             f"max-concurrency {limits.max_concurrency}" if limits.max_concurrency is not None else None,
             f"token budget {limits.token_budget}/{limits.budget_period}" if limits.token_budget is not None else None]
    return ", ".join(p for p in parts if p) or "none (unlimited)"


def _scheduling_text(t: TenantInfo) -> str:
    timeout = f"{t.request_timeout:g} s" if t.request_timeout else "the server's"
    return f"weight {t.weight:g}, request timeout {timeout}"


def tenant_update(db: Database, name: str, key: str | None, quotas: dict, clear: bool = False,
                  scheduling: dict | None = None) -> int:
    from loraplex.platform.errors import BadRequestError
    from loraplex.platform.quotas.limits import set_quota

    if not quotas and not clear and not scheduling:
        raise BadRequestError("nothing to change: give --weight, --request-timeout, --rpm, --tpm, "
                              "--max-concurrency, --token-budget, --budget-period or --clear-quotas")
    if scheduling and key is not None:
        raise BadRequestError("--weight and --request-timeout are per tenant, not per key: leave out --key")
    if scheduling:
        _out(f"tenant {name}: {_scheduling_text(update_tenant(db, name, **scheduling))}")
        _audit(db, "tenant.update", f"tenant:{name}", **scheduling)
    if not quotas and not clear:
        return 0
    if clear:
        set_quota(db, name, key_prefix=key, rpm=None, tpm=None, max_concurrency=None, token_budget=None)
    if "budget_period" in quotas and "token_budget" not in quotas:
        from loraplex.platform.quotas.limits import get_quota

        if get_quota(db, name, key).limits.token_budget is None:
            raise BadRequestError("--budget-period needs a token budget: give --token-budget too")
    info = set_quota(db, name, key_prefix=key, **quotas)
    who = f"key lpx_{info.key_prefix} of tenant {info.tenant}" if info.key_prefix else f"tenant {info.tenant}"
    _out(f"quotas of {who}: {_limits_text(info.limits)}")
    _audit(db, "quota.update", f"key:lpx_{info.key_prefix}" if info.key_prefix else f"tenant:{info.tenant}",
           tenant=info.tenant, cleared=clear, **quotas)
    return 0


def tenant_show(db: Database, name: str) -> int:
    from loraplex.platform.quotas.limits import list_quotas, quota_status

    st = quota_status(db, name)
    lim = st.quota.limits
    _out(f"tenant {name}")
    _out(f"  scheduling:  {_scheduling_text(tenant_info(db, name))}")
    _out(f"  quotas:      {_limits_text(lim)}")
    _out(f"  this minute: {st.requests_this_minute} requests, {st.tokens_this_minute} tokens")
    _out(f"  in flight:   {st.in_flight}")
    if lim.token_budget is not None:
        _out(f"  budget:      {st.budget_used} of {lim.token_budget} tokens used this {lim.budget_period} "
             f"(resets {st.budget_period_end.isoformat()})")
    for q in list_quotas(db, name):
        if q.key_prefix is not None:
            _out(f"  key lpx_{q.key_prefix}: {_limits_text(q.limits)}")
    return 0


def usage_export(db: Database, start: str, end: str, *, tenant: str | None, fmt: str, granularity: str,
                 source: str | None, include_open: bool, output: str | None) -> int:
    import os
    from pathlib import Path

    from loraplex.platform.metering.usage import DEFAULT_SOURCE, ExportStats, export_usage, parse_time

    stats = ExportStats()
    chunks = export_usage(db, parse_time(start, "--from"), parse_time(end, "--to"), fmt=fmt, granularity=granularity,
                          tenant=tenant, source=source or DEFAULT_SOURCE, include_open=include_open, stats=stats)
    if output is None:
        out = sys.stdout.buffer
        for chunk in chunks:
            out.write(chunk)
        out.flush()
    else:
        path = Path(output)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    _audit(db, "usage.export", f"tenant:{tenant}" if tenant else "usage", format=fmt, granularity=granularity,
           start=start, end=end, records=stats.records, output=output)
    note = f"exported {stats.records} {dict(event='events', hour='hourly records', day='daily records')[granularity]}"
    if stats.skipped_open_periods:
        note += (f"; left out {stats.skipped_open_periods} records of periods not over yet "
                 "(--include-open to include them)")
    print(note + (f" to {output}" if output else ""), file=sys.stderr)
    return 0


def usage_show(db: Database, start: str, end: str, *, tenant: str | None, granularity: str) -> int:
    from loraplex.platform.metering.usage import parse_time, usage_summary

    rows = usage_summary(db, parse_time(start, "--from"), parse_time(end, "--to"), tenant=tenant,
                         granularity=granularity)
    _out(f"{'PERIOD START':22} {'TENANT':16} {'ADAPTER':20} {'REQUESTS':>9} {'PROMPT':>12} {'CACHED':>12} "
         f"{'COMPLETION':>12} {'TOTAL':>12}")
    for r in rows:
        _out(f"{r.period_start.strftime('%Y-%m-%dT%H:%MZ'):22} {r.tenant:16} {r.adapter or '-':20} {r.requests:>9} "
             f"{r.prompt_tokens:>12} {r.cached_tokens:>12} {r.completion_tokens:>12} {r.total_tokens:>12}")
    return 0


def tenant_list(db: Database) -> int:
    rows = list_tenants(db)
    _out(f"{'NAME':24} {'LANE':12} {'ALLOWED LANES':28} {'ENABLED':8} {'WEIGHT':>7} {'TIMEOUT':>8} KEYS")
    for t in rows:
        timeout = f"{t.request_timeout:g}s" if t.request_timeout else "-"
        _out(f"{t.name:24} {t.default_lane:12} {','.join(t.allowed_lanes):28} {str(t.enabled).lower():8} "
             f"{t.weight:>7g} {timeout:>8} {t.num_keys}")
    return 0


def key_create(db: Database, tenant: str, expires_at: dt.datetime | None, name: str | None) -> int:
    key = create_key(db, tenant, expires_at, name)
    _out(key)  # stdout carries only the key, so `KEY=$(loraplex key create t)` works
    _audit(db, "key.create", f"key:lpx_{key.split('_')[1]}", tenant=tenant, name=name,
           expires_at=expires_at.isoformat() if expires_at else None)
    return 0


def key_revoke(db: Database, prefix: str) -> int:
    revoke_key(db, prefix)
    _audit(db, "key.revoke", f"key:lpx_{prefix.removeprefix('lpx_')}")
    print(f"revoked key {prefix} (servers stop accepting it within their auth cache TTL, 5 s by default)",
          file=sys.stderr)
    return 0


def adapter_add(settings: Settings, db: Database, name: str, path: str, *, public: bool, grants: list[str],
                owner: str | None, replace: bool) -> int:
    info = add_adapter(db, open_store(settings), name, path, public=public, grants=grants, owner=owner,
                       replace=replace, reserved=(settings.model_name,), blobs=shared_blob_store(settings, db))
    _audit(db, "adapter.replace" if replace else "adapter.upload", f"adapter:{info.name}", digest=info.digest,
           public=info.public, owner=info.owner, grants=list(info.grants))
    who = "public" if info.public else ", ".join(filter(None, [info.owner and f"owner {info.owner}",
                                                             info.grants and f"granted to {', '.join(info.grants)}"]))
    _out(f"registered adapter {info.name} {info.digest} ({who or 'no tenant may use it yet'})")
    return 0


def adapter_gc(settings: Settings, db: Database, grace: float, store_url: str | None) -> int:
    import dataclasses

    from loraplex.platform.errors import BadRequestError
    from loraplex.platform.tenancy.blob_gc import collect_blobs

    if not grace >= 0:
        raise BadRequestError(f"--grace must be >= 0 seconds, got {grace}")
    blobs = shared_blob_store(dataclasses.replace(settings, adapter_store=store_url) if store_url else settings, db)
    if blobs is None:
        raise BadRequestError("no shared adapter store to collect: give --adapter-store (or "
                              "$LORAPLEX_ADAPTER_STORE), or a PostgreSQL --database-url")
    r = collect_blobs(db, blobs, grace)
    _audit(db, "adapter.gc", "adapter-store", deleted=r.deleted, marked=len(r.marked), grace=grace)
    _out(f"adapter blobs: {len(r.deleted)} deleted, {len(r.marked)} newly unreferenced (deleted by a run after "
         f"{grace:g} s), {r.waiting} waiting, {r.referenced} in use")
    return 0


def adapter_list(db: Database) -> int:
    _out(f"{'NAME':24} {'ACCESS':10} {'OWNER':16} {'GRANTS':24} DIGEST")
    for a in list_adapters(db):
        _out(f"{a.name:24} {'public' if a.public else 'private':10} {a.owner or '-':16} "
             f"{','.join(a.grants) or '-':24} {a.digest}")
    return 0


def _demo_adapters_in_background(settings: Settings, register) -> threading.Thread:
    """Demo adapters may need training (about a minute, once per machine): the server
    starts at once and they appear in /v1/models when ready."""

    def run() -> None:
        db = Database(settings.db_url)
        try:
            added = register(settings, db, open_store(settings), shared_blob_store(settings, db))
            if added:
                log.info("demo adapters ready: %s", ", ".join(added))
        except Exception:  # noqa: BLE001 - a demo convenience must not stop the server
            log.exception("registering the demo adapters failed")
        finally:
            db.dispose()

    thread = threading.Thread(target=run, name="loraplex-demo-adapters", daemon=True)
    thread.start()
    return thread


def serve(settings: Settings, access_log: bool = False) -> int:
    import uvicorn

    from loraplex.platform.admin.auth import ensure_admin_token
    from loraplex.platform.app import create_app
    from loraplex.platform.cli.demo import ensure_demo_tenant, register_cli_adapters, register_demo_adapters
    from loraplex.platform.observability.json_logs import configure_logging
    from loraplex.platform.serving import listener
    from loraplex.platform.assembly.engine_factory import build_engine
    from loraplex.platform.serving.listener import uvicorn_config

    # One root handler in the chosen format; uvicorn's loggers propagate to it.
    configure_logging(settings.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    db = open_db(settings)
    log.info("database %s migrated to the latest schema", Database.display_url(settings.db_url))
    try:
        demo_key = ensure_demo_tenant(db) if settings.create_demo_tenant else None
        register_cli_adapters(settings, db, open_store(settings), shared_blob_store(settings, db))
        adapters = [a.name for a in list_adapters(db)]
    finally:
        db.dispose()
    log.info("loading the model (%s)...", settings.engine.model.model)
    engine = build_engine(settings)
    admin_token = ensure_admin_token(settings)  # first start without $LORAPLEX_ADMIN_TOKEN
    app = create_app(settings, engine)
    url = f"http://{settings.host}:{settings.port}"
    _out(f"loraplex: serving {settings.model_name}" + (f" + adapters {', '.join(adapters)}" if adapters else ""))
    metrics_url = f"http://{settings.metrics_host}:{settings.metrics_port}" if settings.metrics_port else url
    _out(f"loraplex: OpenAI-compatible API at {url}/v1  (metrics {metrics_url}/metrics)")
    _out(f"loraplex: data in {settings.data_dir}; database {Database.display_url(settings.db_url)}")
    if demo_key:
        _out(f"loraplex: demo tenant 'demo' created; its API key (shown only this once):\n\n    {demo_key}\n")
    _out(f"loraplex: admin UI at {url}/admin  (API {url}/admin/api, described at {url}/admin/api/openapi.json)")
    if admin_token:
        _out(f"loraplex: admin token generated (shown only this once; `loraplex admin-token --reset` makes a new "
             f"one):\n\n    {admin_token}\n")
    if settings.create_demo_tenant:
        _demo_adapters_in_background(settings, register_demo_adapters)
    # log_config=None: uvicorn's loggers propagate to the one root handler set above.
    config = uvicorn_config(app, settings, access_log=access_log, timeout_graceful_shutdown=30, log_level="info",
                            log_config=None)
    try:
        listener.run(listener.serve(uvicorn.Server(config), app, settings))
    finally:
        engine.shutdown()
    return 0


def admin_token(settings: Settings, reset: bool = False) -> int:
    """Say where the admin token comes from; with `reset`, make a new one (printed once)."""
    from loraplex.platform.admin.auth import ADMIN_TOKEN_ENV, configured_token_hashes, new_admin_token, write_token_file

    if reset:
        if os.environ.get(ADMIN_TOKEN_ENV, "").strip():
            print(f"loraplex: ${ADMIN_TOKEN_ENV} is set, and wins over a generated token: change it there",
                  file=sys.stderr)
            return 1
        # The database first: while it cannot be reached the token stays as it was, rather
        # than changing with no audit row.
        db = open_db(settings)
        try:
            token = new_admin_token()
            path = write_token_file(settings, token)
            _audit(db, "admin_token.reset", "admin-token", token_file=str(path))
        finally:
            db.dispose()
        print(f"new admin token (its hash is in {path}; servers using this data dir accept it at once, "
              "and no longer the old one):", file=sys.stderr)
        _out(token)  # stdout carries only the token
        return 0
    hashes, source = configured_token_hashes(settings)
    if not hashes:
        _out(f"no admin token yet: `loraplex serve` generates one at first start, or set ${ADMIN_TOKEN_ENV}")
    else:
        _out(f"admin token from {source}; `loraplex admin-token --reset` replaces a generated one")
    return 0
