"""The `loraplex` command line: serve, tenant, key, adapter.

Errors print one line naming the problem and exit non-zero; never a traceback
(set LORAPLEX_DEBUG=1 to get one).
"""
from __future__ import annotations

import argparse
import datetime as dt
import logging
import math
import os
import sys

from sqlalchemy.exc import SQLAlchemyError

from loraplex.adapters.errors import AdapterError
from loraplex.engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig,
                                    SpeculativeConfig)
from loraplex.engine.runner.device import DEVICE_CHOICES, DeviceUnavailableError, resolve_device
from loraplex.engine.errors import EngineError
from loraplex.engine.runner.memory_budget import DeviceMemoryError

from loraplex.platform.cli import gateway as gateway_cli
from loraplex.platform.cli import roles
from loraplex.platform.cli.options import (
    CLEAR,
    adapter_cache_option,
    adapters_from_args,
    lora_modules_option,
    parse_size,
    seconds_arg,
    server_options,
    server_settings,
    serving_options,
    speculative_config_arg,
)
from loraplex.platform.errors import PlatformError, WeakSecretError
from loraplex.platform.settings import Settings, default_data_dir

def _adapter_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapter takes NAME=PATH, got {text!r}")
    return name, path


def _default_threads() -> int:
    # Half the usable cores: the engine's matmuls share the machine with the HTTP side.
    return max(1, len(os.sched_getaffinity(0)) // 2) if hasattr(os, "sched_getaffinity") else 1




def _limit_arg(text: str) -> int | None:
    """A limit: a whole number >= 0, or none/off/unlimited to clear it."""
    if text.strip().lower() in CLEAR:
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a limit: {text!r} (use a whole number, or 'none' to clear it)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a limit must be >= 0, got {value}")
    return value


def _quota_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quotas (a number, or 'none' to clear a limit; changes apply within 5 s)")
    g.add_argument("--rpm", type=_limit_arg, default=argparse.SUPPRESS, metavar="N", help="requests per minute")
    g.add_argument("--tpm", type=_limit_arg, default=argparse.SUPPRESS, metavar="N",
                   help="tokens per minute (prompt + max_tokens reserved at admission, settled to actual use)")
    g.add_argument("--max-concurrency", type=_limit_arg, default=argparse.SUPPRESS, metavar="N",
                   help="requests in flight at once")
    g.add_argument("--token-budget", type=_limit_arg, default=argparse.SUPPRESS, metavar="N",
                   help="tokens per budget period (hard limit)")
    g.add_argument("--budget-period", choices=("day", "month"), default=argparse.SUPPRESS,
                   help="the budget's period, UTC (default month)")


def _quota_values(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("rpm", "tpm", "max_concurrency", "token_budget", "budget_period")
            if hasattr(args, k)}


def _scheduling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--weight", type=float, default=argparse.SUPPRESS, metavar="W",
                   help="its share of the engine inside a lane, relative to other tenants (default 1)")
    g.add_argument("--request-timeout", type=seconds_arg, default=argparse.SUPPRESS, metavar="S",
                   help="seconds a request may run before the engine ends it ('none': the server's --request-timeout)")


def _scheduling_values(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("weight", "request_timeout") if hasattr(args, k)}


def _db_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help=f"data folder (default {default_data_dir()})")
    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL, e.g. postgresql://user@host/db (default: SQLite in the data dir)")


def _number_arg(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return value


def _non_negative_arg(text: str) -> float:
    return _number_arg(text, lambda v: v >= 0, "a number >= 0")


def _positive_arg(text: str) -> float:
    return _number_arg(text, lambda v: v > 0, "a number > 0")


def _fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"not a fraction in (0, 1]: {text!r} (e.g. 0.9)")
    return value


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", metavar="DEVICE",
                   help=f"{DEVICE_CHOICES} (default auto: the first CUDA GPU torch sees, else the CPU)")
    g.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    g.add_argument("--kernels", choices=("auto", "triton", "cpu", "torch"), default="auto",
                   help="kernel backend (default auto: Triton on CUDA; on a CPU the C kernels where they build)")
    g.add_argument("--gpu-memory-utilization", type=_fraction_arg, default=0.9, metavar="F",
                   help="fraction of the GPU's memory to use: the KV cache gets what the weights, adapter "
                        "slots and activations leave (default 0.9)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV pool size, e.g. 1GiB (default: 1GiB on a CPU; on a GPU what "
                        "--gpu-memory-utilization leaves)")
    g.add_argument("--enforce-eager", action="store_true", help="no replayed decode steps (CUDA graphs; on a CPU, recorded kernel calls)")
    g.add_argument("--speculative-config", type=speculative_config_arg, default=SpeculativeConfig(), metavar="JSON",
                   help='speculative decoding, as vLLM\'s flag: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (default: off)')
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling", choices=("fair", "fcfs"), default="fair",
                   help="order inside a lane: fair shares it between tenants by the tokens they were served, "
                        "by their weights, and bounds each tenant's share of the waiting queue (HTTP 429 beyond "
                        "it); fcfs serves by arrival (default fair)")
    g.add_argument("--lane-hold-seconds", type=_non_negative_arg, default=60.0, metavar="S",
                   help="a lane stays the foreground this long after its last request left (default 60)")
    g.add_argument("--background-step-ms", type=_positive_arg, default=50.0, metavar="MS",
                   help="while a higher lane is the foreground, lower lanes run in steps sized to take about "
                        "this long, so an arrival in the foreground waits little (default 50)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores)")
    g.add_argument("--max-loras", type=int, default=None,
                   help="cap on adapters resident on the device (default: none; bounded by the KV pool's memory)")
    g.add_argument("--max-cpu-loras", type=int, default=32, help="adapters kept in CPU memory")
    g.add_argument("--max-lora-rank", type=int, default=64)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant multi-LoRA LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    _db_options(serve)
    serve.add_argument("--model", default="default", help="a Hugging Face folder, or 'default' (SmolLM2-135M)")
    serve.add_argument("--served-model-name", default=None, help="the base model's id in the API")
    serve.add_argument("--adapter", action="append", type=_adapter_arg, default=[], metavar="NAME=PATH",
                       help="register a PEFT adapter (public); repeatable")
    lora_modules_option(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--no-demo", action="store_true", help="no demo tenant, no demo adapters")
    serve.add_argument("--adapter-store", default=None, metavar="URL",
                       help="the adapter store replicas share: a folder, s3://bucket/prefix or a database URL "
                            "(default: $LORAPLEX_ADAPTER_STORE, else the database when it is PostgreSQL)")
    adapter_cache_option(serve)
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serving_options(serve)
    _engine_options(serve)
    server_options(serve)
    roles.add_worker_parser(sub, _db_options, _engine_options)
    roles.add_migrate_parser(sub, _db_options)

    tenant = sub.add_parser("tenant", help="manage tenants").add_subparsers(dest="action", required=True)
    tc = tenant.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--lane", default="standard", help="interactive, standard or batch (default standard)")
    tc.add_argument("--allowed-lanes", default=None, help="comma-separated lanes it may ask for (default: "
                    "its lane and every lower one)")
    _scheduling_options(tc)
    _quota_options(tc)
    _db_options(tc)
    tu = tenant.add_parser("update", help="change a tenant's weight, request timeout or quotas (or one of its keys' quotas)")
    tu.add_argument("name")
    tu.add_argument("--key", default=None, metavar="PREFIX", help="set the quotas of this API key, not the tenant's")
    tu.add_argument("--clear-quotas", action="store_true", help="remove every limit (before applying the others)")
    _scheduling_options(tu)
    _quota_options(tu)
    _db_options(tu)
    ts = tenant.add_parser("show", help="a tenant's quotas and where it stands against them")
    ts.add_argument("name")
    _db_options(ts)
    _db_options(tenant.add_parser("list", help="list tenants"))

    key = sub.add_parser("key", help="manage API keys").add_subparsers(dest="action", required=True)
    kc = key.add_parser("create", help="create a key; prints only the key")
    kc.add_argument("tenant")
    kc.add_argument("--expires-in-days", type=float, default=None)
    kc.add_argument("--name", default=None, help="a note to remember the key by")
    _db_options(kc)
    kr = key.add_parser("revoke", help="revoke a key by its visible prefix")
    kr.add_argument("prefix")
    _db_options(kr)

    adapter = sub.add_parser("adapter", help="manage adapters").add_subparsers(dest="action", required=True)
    aa = adapter.add_parser("add", help="validate, store and register a PEFT LoRA adapter")
    aa.add_argument("name")
    aa.add_argument("path", help="a PEFT adapter folder (or .zip)")
    who = aa.add_mutually_exclusive_group()
    who.add_argument("--public", action="store_true", help="every tenant may use it")
    who.add_argument("--grant", action="append", default=[], metavar="TENANT", help="grant a tenant; repeatable")
    aa.add_argument("--owner", default=None, metavar="TENANT", help="the tenant that owns it (may use it)")
    aa.add_argument("--replace", action="store_true", help="register a new version of an existing adapter")
    aa.add_argument("--model", default="default", help="the base model it must fit (default: SmolLM2)")
    _db_options(aa)
    _db_options(adapter.add_parser("list", help="list adapters"))
    gc = adapter.add_parser("gc", help="delete shared-store blobs no adapter names (after a grace period)",
                            description="Blobs seen unreferenced for the first time are marked; a later run "
                                        "deletes those marked more than --grace seconds ago.")
    gc.add_argument("--grace", type=float, default=Settings.adapter_gc_grace_seconds, metavar="S",
                    help="seconds a blob stays after it was first seen unreferenced (default 3600)")
    gc.add_argument("--adapter-store", default=None, metavar="URL",
                    help="the shared store: a folder, s3://bucket/prefix or a database URL "
                         "(default: $LORAPLEX_ADAPTER_STORE, else the database when it is PostgreSQL)")
    _db_options(gc)

    usage = sub.add_parser("usage", help="usage and billing export").add_subparsers(dest="action", required=True)
    ue = usage.add_parser("export", help="export usage for billing (to stdout, or --output FILE)",
                          description="Times are UTC ISO 8601 dates (2026-01-01) or times (2026-01-01T10:00:00Z); "
                                      "the range is [--from, --to). Events count at the time their request finished.")
    ue.add_argument("--from", dest="start", required=True, metavar="T", help="start (inclusive)")
    ue.add_argument("--to", dest="end", required=True, metavar="T", help="end (exclusive)")
    ue.add_argument("--tenant", default=None, metavar="NAME")
    ue.add_argument("--format", choices=("csv", "jsonl", "cloudevents"), default="csv")
    ue.add_argument("--granularity", choices=("event", "hour", "day"), default="event",
                    help="one record per request (default), or per tenant, adapter and hour/day")
    ue.add_argument("--source", default=None, help="CloudEvents source (default //loraplex/usage)")
    ue.add_argument("--include-open", action="store_true",
                    help="cloudevents aggregates: include periods not over yet (their ids repeat when re-exported)")
    ue.add_argument("--output", "-o", default=None, metavar="FILE", help="write here (atomically) instead of stdout")
    _db_options(ue)
    us = usage.add_parser("show", help="usage per tenant and adapter (from the hourly rollups)")
    us.add_argument("--from", dest="start", required=True, metavar="T")
    us.add_argument("--to", dest="end", required=True, metavar="T")
    us.add_argument("--tenant", default=None, metavar="NAME")
    us.add_argument("--granularity", choices=("hour", "day", "total"), default="total")
    _db_options(us)
    at = sub.add_parser("admin-token", help="where the admin UI's token comes from; --reset makes a new one")
    at.add_argument("--reset", action="store_true",
                    help="generate a new admin token (printed once); the old one and its sessions stop working")
    _db_options(at)  # (only --data-dir matters: the generated token's hash lives there)
    gateway_cli.add_parser(sub, _db_options, serving_options, server_options)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The `_engine_options` group (and --model) -> an EngineConfig, the device resolved:
    `DeviceUnavailableError` when --device names one this machine lacks."""
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                        kv_cache_memory_bytes=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=not args.no_prefix_caching)
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          device=resolve_device(args.device)),
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill, scheduling=args.scheduling,
                                  lane_hold_seconds=args.lane_hold_seconds,
                                  background_step_seconds=args.background_step_ms / 1000),
        lora=LoRAConfig(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank),
        num_threads=args.threads or _default_threads(),
        kernels=args.kernels,
        enforce_eager=args.enforce_eager,
        speculative=args.speculative_config,
    )



def settings_from_args(args: argparse.Namespace) -> Settings:
    kw = {}
    if args.data_dir:
        kw["data_dir"] = args.data_dir
    if getattr(args, "command", None) not in ("serve", "worker"):
        return Settings(database_url=args.database_url,
                        engine=EngineConfig(model=ModelConfig(model=getattr(args, "model", "default"))), **kw)
    engine = engine_config_from_args(args)
    names = Settings(engine=engine, served_model_name=args.served_model_name).model_name, args.model
    return Settings(engine=engine, database_url=args.database_url, host=args.host, port=args.port,
                    served_model_name=args.served_model_name, adapters=adapters_from_args(args, names),
                    create_demo_tenant=not args.no_demo, request_timeout=getattr(args, "request_timeout", 0) or None,
                    log_format=getattr(args, "log_format", "text"), otlp_endpoint=getattr(args, "otlp_endpoint", None),
                    **(server_settings(args) if args.command == "serve" else {}),
                    **({"adapter_store": args.adapter_store, "adapter_cache_max_bytes": args.adapter_cache_size}
                       if args.command == "serve" else {}), **kw)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = _dispatch(args)
    except (DeviceUnavailableError, DeviceMemoryError, WeakSecretError) as exc:
        # Configuration the machine cannot honour, or a secret that is none: a usage error, as argparse's are.
        code = _fail(str(exc), code=2)
    except (PlatformError, AdapterError, EngineError, ValueError) as exc:
        code = _fail(getattr(exc, "reason", None) or str(exc))
    except SQLAlchemyError as exc:
        code = _fail(f"database error: {str(exc.orig if getattr(exc, 'orig', None) else exc).strip()}")
    except OSError as exc:
        code = _fail(str(exc))
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)


def _fail(message: str, code: int = 1) -> int:
    if os.environ.get("LORAPLEX_DEBUG"):
        raise
    print(f"loraplex: error: {message.splitlines()[0] if message else 'unknown error'}", file=sys.stderr)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    from loraplex.platform.cli import commands

    if args.command == "gateway":
        return gateway_cli.gateway(args)
    settings = settings_from_args(args)
    if args.command == "serve":
        return commands.serve(settings, access_log=args.access_log)
    if args.command == "admin-token":
        return commands.admin_token(settings, reset=args.reset)
    if args.command == "worker":
        return roles.worker(settings, args)
    if args.command == "migrate":
        return roles.migrate(settings)
    db = commands.open_db(settings)
    try:
        if args.command == "tenant" and args.action == "create":
            allowed = args.allowed_lanes.split(",") if args.allowed_lanes else None
            return commands.tenant_create(db, args.name, args.lane, allowed, _quota_values(args),
                                          **_scheduling_values(args))
        if args.command == "tenant" and args.action == "update":
            return commands.tenant_update(db, args.name, args.key, _quota_values(args), clear=args.clear_quotas,
                                          scheduling=_scheduling_values(args))
        if args.command == "tenant" and args.action == "show":
            return commands.tenant_show(db, args.name)
        if args.command == "usage" and args.action == "export":
            return commands.usage_export(db, args.start, args.end, tenant=args.tenant, fmt=args.format,
                                         granularity=args.granularity, source=args.source,
                                         include_open=args.include_open, output=args.output)
        if args.command == "usage":
            return commands.usage_show(db, args.start, args.end, tenant=args.tenant, granularity=args.granularity)
        if args.command == "tenant":
            return commands.tenant_list(db)
        if args.command == "key" and args.action == "create":
            expires = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=args.expires_in_days)
                       if args.expires_in_days is not None else None)
            return commands.key_create(db, args.tenant, expires, args.name)
        if args.command == "key":
            return commands.key_revoke(db, args.prefix)
        if args.command == "adapter" and args.action == "add":
            return commands.adapter_add(settings, db, args.name, args.path, public=args.public, grants=args.grant,
                                        owner=args.owner, replace=args.replace)
        if args.command == "adapter" and args.action == "gc":
            return commands.adapter_gc(settings, db, args.grace, args.adapter_store)
        return commands.adapter_list(db)
    finally:
        db.dispose()


if __name__ == "__main__":
    logging.basicConfig()
    main()
