"""A live loraplex server (uvicorn on a free local port, in a thread) over a tiny random
Llama, with tenants, keys and adapters, once per database backend (SQLite, PostgreSQL)."""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
import torch
import uvicorn

from loraplex.engine.client import EngineStats
from loraplex.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store
from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.assembly.engine_factory import build_engine
from loraplex.platform.errors import RateLimitedError
from loraplex.platform.serving.hooks import Hooks, RequestContext
from loraplex.platform.settings import AuthConfig, ServerLimits, Settings
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.platform.fixtures import BACKENDS, empty_db_url, fresh_db_url, pg_schema_url, tiny_adapters  # noqa: F401

MAX_MODEL_LEN = 256


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The machine's cores are shared: one torch thread in these tests, restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class LiveServer:
    """uvicorn serving `app` in a thread, on a socket bound to a free port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the live server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@dataclass
class RecordingHooks(Hooks):
    """Admission/metering hooks that record every request; tenant `limited` gets 429."""

    admitted: list[RequestContext] = field(default_factory=list)
    finished: list[RequestContext] = field(default_factory=list)

    async def admit(self, ctx: RequestContext) -> None:
        if ctx.principal.tenant == "limited":
            raise RateLimitedError("tenant limited is over its requests-per-minute limit", retry_after=7)
        self.admitted.append(ctx)

    async def finish(self, ctx: RequestContext) -> None:
        self.finished.append(ctx)


@dataclass
class Live:
    backend: str
    url: str
    model: str
    keys: dict[str, str]
    db: Database
    settings: Settings
    app: object
    engine: object
    hooks: RecordingHooks

    def client(self, tenant: str = "acme", base: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{base or '/v1'}", api_key=self.keys.get(tenant, tenant),
                             max_retries=0, timeout=60, **kw)

    @property
    def gateway(self):
        return self.app.state.gateway


def tiny_engine_config(model_dir: Path, **scheduler) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
                        cache=CacheConfig(num_blocks=128, block_size=16), scheduler=SchedulerConfig(**scheduler),
                        num_threads=1)


@pytest.fixture(scope="session")
def base_settings(tmp_path_factory, tiny_llama_dir) -> Settings:
    # Tests send large bodies back to back from one tenant to reach other caps, and count
    # many 429s; the body budget and the refusal hold have tests of their own
    # (tests/e2e/isolation/).
    return Settings(engine=tiny_engine_config(tiny_llama_dir), data_dir=tmp_path_factory.mktemp("loraplex_data"),
                    auth=AuthConfig(cache_ttl=0.5, negative_ttl=0.5, last_used_flush_seconds=0.5),
                    limits=ServerLimits(body_bytes_per_second=1 << 30, refusal_hold=0))


@pytest.fixture(scope="session")
def tiny_engine(base_settings):
    engine = build_engine(base_settings)
    yield engine
    engine.shutdown()


TENANTS = {"acme": "interactive", "beta": "standard", "gamma": "batch", "limited": "standard"}
ADAPTERS = {"acme-private": ("ad1", {"owner": "acme"}), "shared": ("ad2", {"grants": ["beta"]}),
            "pub": ("ad3", {"public": True})}


def _populate(db: Database, settings: Settings, adapters: dict[str, Path]) -> dict[str, str]:
    keys = {}
    for name, lane in TENANTS.items():
        create_tenant(db, name, lane, ["batch"] if name == "gamma" else None)
        keys[name] = create_key(db, name)
    store = open_store(settings)
    for name, (src, access) in ADAPTERS.items():
        add_adapter(db, store, name, adapters[src], **access)
    return keys


@pytest.fixture(scope="session", params=BACKENDS)
def live(request, tmp_path_factory, base_settings, tiny_engine, tiny_adapters, pg_schema_url) -> Iterator[Live]:  # noqa: F811
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("db"), pg_schema_url)
    migrate(url)
    db = Database(url)
    settings = dataclasses.replace(base_settings, database_url=url)
    keys = _populate(db, settings, tiny_adapters)
    hooks = RecordingHooks()
    app = create_app(settings, tiny_engine, hooks=hooks)
    with LiveServer(app) as server:
        yield Live(request.param, server.url, settings.model_name, keys, db, settings, app, tiny_engine, hooks)
    db.dispose()


def engine_stats(engine) -> EngineStats:
    """Fresh stats, read on the engine thread (AsyncEngine.stats() is the snapshot of the
    last step, which an abort on an otherwise idle engine does not refresh)."""
    return asyncio.run(engine.call(lambda e: e.stats()))


def wait_idle(engine, timeout: float = 10.0) -> bool:
    """True once the engine has nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine_stats(engine)
        if s.running == 0 and s.waiting == 0:
            return True
        time.sleep(0.01)
    return False
