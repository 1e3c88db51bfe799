"""Platform settings: one frozen dataclass composed with the engine's `EngineConfig`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.config import DEFAULT_MODEL, EngineConfig

DATA_DIR_ENV = "LORAPLEX_DATA_DIR"
DATABASE_URL_ENV = "LORAPLEX_DATABASE_URL"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_data_dir() -> Path:
    """$LORAPLEX_DATA_DIR, else $XDG_DATA_HOME/loraplex, else ~/.local/share/loraplex."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "loraplex"


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    data_dir: Path = field(default_factory=default_data_dir)
    # None: $LORAPLEX_DATABASE_URL, else SQLite at <data_dir>/loraplex.db.
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    # The id /v1/models shows for the base model; None derives it from the model path.
    served_model_name: str | None = None
    # (name, path) pairs registered (public) at `serve` start.
    adapters: tuple[tuple[str, str], ...] = ()
    # How long a validated API key is trusted without asking the database again. A key
    # revoked (or a tenant disabled, or a grant removed) elsewhere stops working within
    # this many seconds; expiry is checked on every request and is exact.
    auth_cache_ttl: float = 5.0
    # Unknown keys are remembered this long, so a flood of bad keys cannot hammer the DB.
    auth_negative_ttl: float = 2.0
    # last_used_at is kept in memory and written in one batch this often (and at shutdown).
    last_used_flush_seconds: float = 30.0
    # `serve`: create the demo tenant (and print its key) on first start.
    create_demo_tenant: bool = True
    # The admin API's token; None: $LORAPLEX_ADMIN_TOKEN, else the one `serve` generated
    # at first start (its hash is in <data_dir>/admin-token.sha256). See admin/auth.py.
    admin_token: str | None = None
    # Adapter uploads through the admin API larger than this are refused (413).
    admin_max_upload_bytes: int = 1 << 30
    # Quotas (quotas/): limits are cached per process this long (a change applies within
    # it); a dead process's quota leases expire (and are given back) after this long.
    quota_cache_ttl: float = 5.0
    quota_lease_ttl: float = 60.0
    # Metering (metering/writer.py): the usage writer's batch size and flush interval, and the
    # backlog of unwritten events at which new requests get 503 until the DB catches up.
    usage_batch_size: int = 500
    usage_flush_seconds: float = 0.25
    usage_max_buffer: int = 100_000
    # Seconds a request may run before the engine ends it (finish reason "timeout"),
    # unless its tenant has its own; None: no limit.
    request_timeout: float | None = None
    # Observability: "text" or "json" log lines; an OTLP/HTTP traces endpoint turns
    # tracing on (e.g. http://collector:4318/v1/traces), None leaves it off.
    log_format: str = "text"
    otlp_endpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.auth_cache_ttl < 0 or self.auth_negative_ttl < 0:
            raise ValueError("auth cache TTLs must be >= 0")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ValueError("request_timeout must be a finite number of seconds > 0")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")

    @property
    def db_url(self) -> str:
        url = self.database_url or os.environ.get(DATABASE_URL_ENV)
        return url or f"sqlite:///{self.data_dir / 'loraplex.db'}"

    @property
    def adapter_dir(self) -> Path:
        return self.data_dir / "adapters"

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model.model
        if model == DEFAULT_MODEL:
            return DEFAULT_MODEL_NAME
        return Path(model).expanduser().resolve().name or model
