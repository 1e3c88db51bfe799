"""`loraplex worker` and `loraplex migrate`: the scale-out roles' commands."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.platform.cli.options import adapter_cache_option, observability_options
from loraplex.platform.settings import Settings

if TYPE_CHECKING:
    from loraplex.platform.worker import WorkerConfig


def add_worker_parser(sub, db_options: Callable[[argparse.ArgumentParser], None],
                      engine_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """`loraplex worker`: serve's engine knobs (the same option group), the worker's own."""
    w = sub.add_parser("worker", help="run the engine alone behind the internal API a gateway drives",
                       description="Listens beyond loopback only with $LORAPLEX_INTERNAL_TOKEN set.")
    db_options(w)
    w.add_argument("--adapter-store", default=None, metavar="s3://BUCKET/PREFIX",
                   help="fetch adapters from this S3 bucket (default: the database's adapter_blobs table)")
    w.add_argument("--cache-dir", default=None,
                   help="where fetched adapters are cached (default $LORAPLEX_CACHE_DIR/adapters)")
    adapter_cache_option(w)
    w.add_argument("--model", default="default", help="a Hugging Face folder, or 'default' (SmolLM2-135M)")
    w.add_argument("--served-model-name", default=None, help="the base model's id the gateways show")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, default=8001)
    w.add_argument("--metrics-host", default="127.0.0.1",
                   help="the --metrics-port listener's address (default loopback)")
    w.add_argument("--metrics-port", type=int, default=0,
                   help="/metrics (still behind the internal token) on this port of its own, so a network "
                        "policy can let scrapers reach it and not the internal API; 0 (default): on --port")
    w.add_argument("--access-log", action="store_true", help="log every HTTP request")
    observability_options(w)
    engine_options(w)
    w.set_defaults(adapter=[], no_demo=True)  # what the serve-shaped settings read


def add_migrate_parser(sub, db_options: Callable[[argparse.ArgumentParser], None]) -> None:
    m = sub.add_parser("migrate", help="migrate the database to the latest schema (what serve runs at start)")
    db_options(m)


def worker_config(settings: Settings, args: argparse.Namespace) -> WorkerConfig:
    """The `loraplex worker` flags -> its WorkerConfig; ConfigError for a wrong adapter store."""
    from loraplex.engine.checkpoint import default_cache_dir
    from loraplex.platform.errors import ConfigError
    from loraplex.platform.worker import WorkerConfig

    if args.adapter_store and args.database_url:
        raise ConfigError("give --database-url or --adapter-store, not both: a worker reads one adapter store")
    if args.adapter_store and not args.adapter_store.startswith("s3://"):
        raise ConfigError(f"--adapter-store takes s3://bucket/prefix, got {args.adapter_store!r}")
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_dir() / "adapters"
    return WorkerConfig(adapter_store=args.adapter_store or settings.db_url, cache_dir=cache,
                        cache_max_bytes=args.adapter_cache_size, host=args.host, port=args.port,
                        metrics_host=args.metrics_host, metrics_port=args.metrics_port or None)


def worker(settings: Settings, args: argparse.Namespace) -> int:
    from loraplex.platform.observability.json_logs import configure_logging
    from loraplex.platform.worker import run_worker

    config = worker_config(settings, args)
    config.check()  # a refusal leaves the process's logging as it found it
    # One root handler in the chosen format; uvicorn's loggers propagate to it (run_worker).
    configure_logging(settings.log_format)
    return run_worker(settings, config, access_log=args.access_log)


def migrate(settings: Settings) -> int:
    from loraplex.platform.db.database import Database, migrate

    migrate(settings.db_url)  # exactly what `loraplex serve` runs at start (commands.open_db)
    print(f"database {Database.display_url(settings.db_url)} migrated to the latest schema", file=sys.stderr)
    return 0
