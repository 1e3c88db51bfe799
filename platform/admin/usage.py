"""Admin API handlers: the engine's status, the audit log, and usage (series and export)."""
from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loraplex.adapters import AdapterNotFoundError

from loraplex.platform.metering import usage
from loraplex.platform.tenancy import audit
from loraplex.platform.admin.auth import Admin
from loraplex.platform.admin.state import AdminState
from loraplex.platform.errors import BadRequestError
from loraplex.platform.db.base import utcnow
from loraplex.platform.lanes import lane_name

BASE_MODEL_KEY = "(base model)"


# -- handlers: engine, audit, usage -----------------------------------------------------

async def engine_status(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    gw = st.gateway
    stats = gw.engine.stats()
    where = stats.adapters.where()
    def digest_names() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for cur in st.store.list():
            try:
                versions = st.store.versions(cur.name)
            except AdapterNotFoundError:  # removed meanwhile
                continue
            for i, r in enumerate(versions):
                out.setdefault(r.digest, []).append(r.name if i == 0 else f"{r.name} (older version)")
        return out

    names = await asyncio.to_thread(digest_names)
    resident = [{"digest": d, "tier": tier, "names": names.get(d, [])} for d, tier in where.items()]
    resident.sort(key=lambda x: (x["tier"] != "device", x["names"], x["digest"]))
    return {
        "model": gw.model_name, "running": gw.engine.is_running and not gw.draining,
        "device": stats.device, "num_running": stats.running, "num_waiting": stats.waiting,
        "lanes": {lane_name(lane): {"running": depth.running, "waiting": depth.waiting}
                  for lane, depth in stats.lanes.items()},
        "kv_cache_usage": stats.kv_cache_usage, "num_kv_blocks": stats.num_blocks,
        "block_size": stats.block_size, "num_preemptions": stats.num_preemptions,
        "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
        "max_loras": stats.max_loras, "max_cpu_loras": stats.max_cpu_loras,
        "resident_adapters": resident,
        "stats_time": dt.datetime.fromtimestamp(stats.time, dt.timezone.utc) if stats.time else None,
    }


async def list_audit(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    def load():
        with st.db.session() as s:
            rows = audit.entries(s, limit=query.get("limit", 100), before_id=query.get("before"),
                                 action=query.get("action"), target=query.get("target"))
            return [{"id": r.id, "at": r.created_at, "actor": r.actor, "action": r.action, "target": r.target,
                     "details": r.details or {}} for r in rows]

    return await asyncio.to_thread(load)


def _usage_range(query: dict, granularity: str) -> tuple[dt.datetime, dt.datetime]:
    """[from, to): defaults to the last 24 hours (hourly) or 30 days (daily), aligned."""
    step = dt.timedelta(days=1) if granularity == "day" else dt.timedelta(hours=1)
    now = utcnow()
    floor = (now.replace(hour=0, minute=0, second=0, microsecond=0) if granularity == "day"
             else now.replace(minute=0, second=0, microsecond=0))
    end = usage.parse_time(query["to"], "to") if query.get("to") else floor + step
    start = usage.parse_time(query["from"], "from") if query.get("from") else end - step * (30 if step.days else 24)
    if end <= start:
        raise BadRequestError("to: must be after from", "to")
    if (end - start) / step > 5000:
        raise BadRequestError(f"the range holds over 5000 {granularity}s: pick a shorter range or a coarser "
                              "granularity", "from")
    return start, end


SERIES_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")


async def usage_series(request: Request, st: AdminState, admin: Admin, query: dict) -> Any:
    granularity = query.get("granularity", "hour")
    group = query.get("group_by", "tenant")
    start, end = _usage_range(query, granularity)
    rows = await asyncio.to_thread(usage.usage_summary, st.db, start, end, tenant=query.get("tenant"),
                                   adapter=query.get("adapter"), granularity=granularity,
                                   by_adapter=group == "adapter")
    series: dict[str, dict[dt.datetime, dict[str, int]]] = {}
    for r in rows:
        key = r.tenant if group == "tenant" else (r.adapter or BASE_MODEL_KEY)
        point = series.setdefault(key, {}).setdefault(r.period_start, dict.fromkeys(SERIES_FIELDS, 0))
        for f in SERIES_FIELDS:
            point[f] += getattr(r, f)
    totals = {k: {f: sum(p[f] for p in pts.values()) for f in SERIES_FIELDS} for k, pts in series.items()}
    ordered = sorted(series, key=lambda k: -totals[k]["total_tokens"])
    return {"from": start, "to": end, "granularity": granularity, "group_by": group,
            "series": [{"key": k, "totals": totals[k],
                        "points": [{"t": t, **series[k][t]} for t in sorted(series[k])]} for k in ordered]}


_EXPORT_TYPES = {"csv": ("text/csv; charset=utf-8", "csv"), "jsonl": ("application/x-ndjson", "jsonl"),
                 "cloudevents": ("application/cloudevents-batch+json", "cloudevents.jsonl")}


async def usage_export(request: Request, st: AdminState, admin: Admin, query: dict) -> Response:
    from starlette.responses import StreamingResponse

    fmt = query.get("format", "csv")
    granularity = query.get("granularity", "event")
    start, end = _usage_range(query, "day" if granularity == "day" else "hour")
    chunks = usage.export_usage(st.db, start, end, fmt=fmt, granularity=granularity, tenant=query.get("tenant"))
    sentinel = object()
    first = await asyncio.to_thread(next, chunks, sentinel)  # argument errors raise here, before the 200

    def body():
        if first is not sentinel:
            yield first
        yield from chunks

    tenant = query.get("tenant")
    await st.audit(admin, "usage.export", f"tenant:{tenant}" if tenant else "usage", format=fmt,
                   granularity=granularity, start=start.isoformat(), end=end.isoformat())
    media, ext = _EXPORT_TYPES[fmt]
    stamp = f"{start:%Y%m%dT%H%M}-{end:%Y%m%dT%H%M}"
    return StreamingResponse(body(), media_type=media, headers={
        "Content-Disposition": f'attachment; filename="loraplex-usage-{granularity}-{stamp}.{ext}"',
        "Cache-Control": "no-store"})
