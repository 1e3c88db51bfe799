"""Platform settings: one frozen dataclass composed of the engine's `EngineConfig` and
one frozen group per subsystem (limits, auth, admin, quotas, usage)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.config import DEFAULT_MODEL, EngineConfig

DATA_DIR_ENV = "LORAPLEX_DATA_DIR"
DATABASE_URL_ENV = "LORAPLEX_DATABASE_URL"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# How much disk the adapter versions a replica or worker fetched from the shared store may
# take in its local cache before the least recently used are removed (--adapter-cache-size).
DEFAULT_ADAPTER_CACHE_BYTES = 10 * 2**30


def default_data_dir() -> Path:
    """$LORAPLEX_DATA_DIR, else $XDG_DATA_HOME/loraplex, else ~/.local/share/loraplex."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "loraplex"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of the HTTP server and of the request parser. Every cap
    is listed with its flag in the README's "Limits" section."""

    # Seconds a client has to send a request's line and headers (slowloris), and to send
    # its body, plus one second per body_min_rate bytes sent (as mod_reqtimeout's MinRate);
    # then the connection is closed.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: int = 8192
    keep_alive_timeout: int = 5
    # Connections plus requests in progress (uvicorn's limit_concurrency); past it, 503
    # (but never to /health and /ready).
    max_connections: int = 1024
    # Connections one client address may hold (trusted proxies excepted); past it, 429.
    max_connections_per_client: int = 128
    # Seconds a 429 is held before it is sent (never past its Retry-After): a client that
    # floods refusals gets at most max_connections_per_client of them per hold from one
    # address, so answering them costs the server little whatever the client's rate.
    refusal_hold: float = 1.0
    # Kernel send buffer of each connection (SO_SNDBUF), and the high-water mark of its
    # transport's buffer: a client that stops reading
    # backs its stream up into the engine, which pauses the request (async_engine.py's
    # PAUSE_BACKLOG), instead of the kernel taking megabytes of output for it (Linux
    # grows a send buffer to 4 MiB on its own). Token streams need a few KiB a second.
    send_buffer_bytes: int = 64 * 1024
    # The same two buffers while a connection streams (SSE, the worker's NDJSON): token
    # streams need a few KiB a second, so a client that stops reading is found (and its
    # request paused, async_engine.py's STALL_SECONDS) after this much instead of the
    # above, and a stalled connection pins this much kernel memory, not four times it.
    stream_send_buffer_bytes: int = 16 * 1024
    backlog: int = 2048
    max_header_bytes: int = 64 * 1024
    # Request bodies: the OpenAI routes, and the admin API's JSON (the adapter upload has
    # Settings.admin.max_upload_bytes); the unauthenticated sign-in gets the small one.
    max_body_bytes: int = 4 * 2**20
    # Request body bytes one tenant may send per second (every route it reaches with its
    # key), past a burst of one largest body: what its JSON costs to parse is bounded.
    body_bytes_per_second: int = 1 * 2**20
    max_admin_body_bytes: int = 1 * 2**20
    max_sign_in_body_bytes: int = 4096
    # Shape of a request's JSON.
    max_json_depth: int = 32
    max_messages: int = 1024
    max_content_parts: int = 256
    # Prompts in one /v1/completions request, and sequences it may generate in all
    # (prompts x n, or x best_of).
    max_prompts: int = 128
    max_choices: int = 256

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "body_min_rate", "max_connections",
                     "max_connections_per_client", "max_header_bytes", "max_body_bytes", "body_bytes_per_second",
                     "max_admin_body_bytes", "max_sign_in_body_bytes", "max_json_depth", "max_messages",
                     "max_content_parts", "max_prompts", "max_choices", "send_buffer_bytes",
                     "stream_send_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.refusal_hold < 0:
            raise ValueError("refusal_hold must be >= 0")


@dataclass(frozen=True)
class AuthConfig:
    """API key authentication (serving/auth.py) and the failed-authentication throttle."""

    # How long a validated API key is trusted without asking the database again. A key
    # revoked (or a tenant disabled, or a grant removed) elsewhere stops working within
    # this many seconds; expiry is checked on every request and is exact.
    cache_ttl: float = 5.0
    # Unknown keys are remembered this long, so a flood of bad keys cannot hammer the DB.
    negative_ttl: float = 2.0
    # Failed authentication (API keys, admin tokens) one client address may make in a
    # burst, and how many per second after it; past that it gets 429 with Retry-After for
    # unknown API keys and admin tokens (valid API keys and admin sessions are still served).
    failure_burst: int = 20
    failure_rate: float = 1.0
    # last_used_at is kept in memory and written in one batch this often (and at shutdown).
    last_used_flush_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.cache_ttl < 0 or self.negative_ttl < 0:
            raise ValueError("auth cache TTLs must be >= 0")
        if self.failure_burst < 1 or not self.failure_rate > 0:
            raise ValueError("auth failure_burst must be >= 1 and failure_rate > 0")


@dataclass(frozen=True)
class AdminConfig:
    """The admin API (admin/)."""

    # The admin API's token; None: $LORAPLEX_ADMIN_TOKEN, else the one `serve` generated
    # at first start (its hash is in <data_dir>/admin-token.sha256). See admin/auth.py.
    token: str | None = None
    # Adapter uploads through the admin API larger than this are refused (413).
    max_upload_bytes: int = 1 << 30
    # Failed admin sign-ins and Bearer tokens are audited as one row per this many seconds
    # (the first at once), however many there were (admin/failed_auth.py).
    audit_failure_window: float = 60.0


@dataclass(frozen=True)
class QuotaConfig:
    """Quotas (quotas/)."""

    # Limits are cached per process this long (a change applies within it).
    cache_ttl: float = 5.0
    # A dead process's quota leases expire (and are given back) after this long.
    lease_ttl: float = 60.0


@dataclass(frozen=True)
class UsageConfig:
    """Metering (metering/writer.py)."""

    # The usage writer's batch size and flush interval, and the backlog of unwritten
    # events at which new requests get 503 until the database catches up.
    batch_size: int = 500
    flush_seconds: float = 0.25
    max_buffer: int = 100_000
    # At shutdown, how long the usage writer keeps trying to put the journal's events into
    # the database before leaving them in the journal (replayed at the next start there).
    drain_seconds: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.drain_seconds < float("inf"):
            raise ValueError("usage drain_seconds must be a finite number of seconds >= 0")


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    data_dir: Path = field(default_factory=default_data_dir)
    # None: $LORAPLEX_DATABASE_URL, else SQLite at <data_dir>/loraplex.db.
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    limits: ServerLimits = field(default_factory=ServerLimits)
    # /metrics on a listener of its own (e.g. 127.0.0.1:9464), away from tenants; None
    # serves it on the main port (embedding the app; `serve` defaults to a port of its own).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    # Proxies whose X-Forwarded-For/-Proto are believed (client address for throttling,
    # https for Secure cookies behind TLS termination); uvicorn's forwarded_allow_ips.
    forwarded_allow_ips: str = "127.0.0.1"
    # The admin session cookie is Secure whatever the request's scheme: for a TLS-terminating
    # proxy (an Ingress) whose X-Forwarded-Proto this process does not trust.
    secure_cookies: bool = False
    # The id /v1/models shows for the base model; None derives it from the model path.
    served_model_name: str | None = None
    # (name, path) pairs registered (public) at `serve` start.
    adapters: tuple[tuple[str, str], ...] = ()
    # API keys (serving/auth.py), the admin API (admin/), quotas (quotas/), metering (metering/).
    auth: AuthConfig = field(default_factory=AuthConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    quotas: QuotaConfig = field(default_factory=QuotaConfig)
    usage: UsageConfig = field(default_factory=UsageConfig)
    # `serve`: create the demo tenant (and print its key) on first start.
    create_demo_tenant: bool = True
    # Where every replica fetches adapter versions from (s3://bucket/prefix or a database
    # URL); None: $LORAPLEX_ADAPTER_STORE, else the platform's database when it is
    # PostgreSQL, else none (the embedded default keeps its local folder only).
    adapter_store: str | None = None
    # The bound on the local cache of versions fetched from a remote shared store (in
    # <data_dir>/blob-cache); None: unbounded.
    adapter_cache_max_bytes: int | None = DEFAULT_ADAPTER_CACHE_BYTES
    # A blob of the shared adapter store that no adapter names is deleted once it was seen
    # unreferenced this long ago (tenancy/blob_gc.py): workers may still be fetching it.
    adapter_gc_grace_seconds: float = 3600.0
    # How often each serving process runs such a pass (0: only after removals and by
    # `loraplex adapter gc`).
    adapter_gc_interval_seconds: float = 900.0
    # Seconds a request may run before the engine ends it (finish reason "timeout"),
    # unless its tenant has its own; None: no limit.
    request_timeout: float | None = None
    # Observability: "text" or "json" log lines; an OTLP/HTTP traces endpoint turns
    # tracing on (e.g. http://collector:4318/v1/traces), None leaves it off.
    log_format: str = "text"
    otlp_endpoint: str | None = None
    # The traces' service.name: tells `serve` from a `gateway` in the tracing backend.
    service_name: str = "loraplex"
    # GAIE InferenceObjective names -> a lane name or a GAIE priority (serving/gaie.py).
    inference_objectives: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ValueError("request_timeout must be a finite number of seconds > 0")
        if self.adapter_cache_max_bytes is not None and self.adapter_cache_max_bytes <= 0:
            raise ValueError("adapter_cache_max_bytes must be > 0 (or None: no bound)")
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
