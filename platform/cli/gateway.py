"""`loraplex gateway`: tenancy, keys, lanes, quotas, metering, admin and routing in front of
engine workers; it loads no model (the workers describe it)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.engine.config import EngineConfig, LoRAConfig, ModelConfig

from loraplex.platform.settings import Settings

if TYPE_CHECKING:
    from loraplex.platform.fleet.config import FleetConfig

log = logging.getLogger("loraplex")


def add_parser(sub: argparse._SubParsersAction, db_options, serving_options, server_options) -> None:
    """The `gateway` subcommand's arguments; the option groups it shares with `serve`
    (--data-dir/--database-url, requests and observability, listener limits) come in."""
    gw = sub.add_parser("gateway", help="run a gateway in front of engine workers (loads no model)")
    where = gw.add_mutually_exclusive_group(required=True)
    where.add_argument("--workers", metavar="URL,...", help="the workers, e.g. http://10.0.0.5:8001,http://...")
    where.add_argument("--workers-dns", metavar="NAME:PORT",
                       help="a DNS name resolving to every worker (a headless Service), re-resolved periodically")
    db_options(gw)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--adapter-store", default=None, metavar="URL",
                    help="where workers fetch adapters: s3://bucket/prefix (default: the PostgreSQL database)")
    gw.add_argument("--router-policy", choices=("affinity", "round_robin"), default="affinity")
    gw.add_argument("--max-in-flight", type=int, default=256, help="requests per worker before 503")
    gw.add_argument("--access-log", action="store_true", help="log every HTTP request")
    serving_options(gw)
    server_options(gw)


def gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.platform.admin.auth import ensure_admin_token
    from loraplex.platform.cli.commands import open_db
    from loraplex.platform.cli.options import server_settings
    from loraplex.platform.observability.json_logs import configure_logging
    from loraplex.platform.serving import listener
    from loraplex.platform.db.database import Database
    from loraplex.platform.fleet.client import RemoteEngineClient
    from loraplex.platform.fleet.config import FleetConfig
    from loraplex.platform.tenancy.adapter_directory import AdapterDirectory
    from loraplex.platform.fleet.model_info import fetch_model_info
    from loraplex.platform.routing import RouterConfig
    from loraplex.platform.app import create_app

    base = Settings(database_url=args.database_url, host=args.host, port=args.port, create_demo_tenant=False,
                    adapter_store=args.adapter_store, request_timeout=args.request_timeout or None,
                    log_format=args.log_format, otlp_endpoint=args.otlp_endpoint, service_name="loraplex-gateway",
                    **server_settings(args),
                    **({"data_dir": args.data_dir} if args.data_dir else {}))
    fleet = FleetConfig(workers=args.workers, workers_dns=args.workers_dns,
                        router=RouterConfig(policy=args.router_policy, max_in_flight=args.max_in_flight))
    check_config(base, fleet)  # a refusal leaves the process's logging as it found it
    # One root handler in the chosen format; uvicorn's loggers propagate to it (log_config=None below).
    configure_logging(args.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    open_db(base).dispose()  # migrate (a no-op when current)
    base.data_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="gateway-model-", dir=base.data_dir))
    served_name, info = fetch_model_info(fleet, model_dir)
    settings = replace(base, served_model_name=served_name, engine=EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=info.max_model_len),
        lora=LoRAConfig(max_loras=max(1, info.max_loras), max_lora_rank=info.max_lora_rank)))
    engine = RemoteEngineClient(fleet, info, AdapterDirectory(Database(settings.db_url)))
    admin_token = ensure_admin_token(settings)
    app = create_app(settings, engine)
    url = f"http://{settings.host}:{settings.port}"
    print(f"loraplex: gateway for {served_name} at {url}/v1 over workers "
          f"{args.workers or args.workers_dns}; database {Database.display_url(settings.db_url)}", flush=True)
    if admin_token:
        print(f"loraplex: admin token generated (shown only this once):\n\n    {admin_token}\n", flush=True)
    # log_config=None: uvicorn's loggers propagate to the one root handler set above.
    server = uvicorn.Server(listener.uvicorn_config(app, settings, access_log=args.access_log,
                                                   timeout_graceful_shutdown=30, log_level="info", log_config=None))
    try:
        listener.run(listener.serve(server, app, settings))
    finally:
        with contextlib.suppress(OSError):
            for f in model_dir.iterdir():
                f.unlink()
            model_dir.rmdir()
    return 0


def check_config(settings: Settings, fleet: FleetConfig) -> None:
    """The refusals that need nothing started or reached: the workers' addresses (not yet
    resolved) and the admin and internal tokens' configuration."""
    from loraplex.platform.admin.auth import configured_token_hashes
    from loraplex.platform.errors import ConfigError
    from loraplex.platform.routing import DiscoveryError, discovery_for

    try:
        discovery_for(fleet.workers, fleet.workers_dns)
    except DiscoveryError as exc:
        raise ConfigError(str(exc)) from None
    configured_token_hashes(settings)  # ConfigError: a token too short, an empty token file
    fleet.token  # noqa: B018 - WeakSecretError: an internal token too short
