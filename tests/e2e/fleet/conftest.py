"""One fleet per test module: PostgreSQL, two engine workers, two gateways over them, and
the all-in-one `serve` as the reference, all real processes on loopback (tiny Llama, one
torch thread each). Tests share it; one that stops or kills a worker restarts it."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from loraplex.engine.config import EngineConfig, ModelConfig
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.adapter_registry import add_adapter, open_store, shared_blob_store
from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.fleet import processes as P
from tests.platform.fixtures import pg_schema_url, tiny_adapters  # noqa: F401 - fixtures

ENGINE_FLAGS = ("--max-model-len", "256", "--num-kv-blocks", "128", "--max-loras", "2", "--max-num-seqs", "16")


@dataclass
class Fleet:
    db: Database
    url: str  # the shared PostgreSQL database
    workers: list[P.Proc]
    gateways: list[P.Proc]
    serve: P.Proc
    key: str  # tenant "acme" (may use every adapter), on the fleet's database
    serve_key: str
    digests: dict[str, str]  # adapter name -> digest (registered ones)
    model: str
    metrics_port: int  # gateway 0's --metrics-port

    def client(self, gateway: int = 0, key: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[gateway].url + "/v1", api_key=key or self.key, max_retries=0,
                             timeout=120, **kw)

    def serve_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.serve.url + "/v1", api_key=self.serve_key, max_retries=0, timeout=120)

    def restart(self, proc: P.Proc) -> None:
        proc.start().wait_ready()


@pytest.fixture(scope="module")
def fleet(pg_schema_url, tiny_llama_dir, tiny_adapters, tmp_path_factory) -> Iterator[Fleet]:  # noqa: F811
    logs = tmp_path_factory.mktemp("fleet")
    url = pg_schema_url()
    migrate(url)
    db = Database(url)
    settings = Settings(engine=EngineConfig(model=ModelConfig(model=str(tiny_llama_dir))), database_url=url,
                        data_dir=logs / "registry")
    store, blobs = open_store(settings), shared_blob_store(settings, db)
    digests = {name: add_adapter(db, store, name, tiny_adapters[name], public=True, blobs=blobs).digest
               for name in ("ad1", "ad2")}
    create_tenant(db, "acme")
    key = create_key(db, "acme")

    serve_url = f"sqlite:///{logs / 'serve.db'}"
    migrate(serve_url)
    serve_db = Database(serve_url)
    create_tenant(serve_db, "acme")
    serve_key = create_key(serve_db, "acme")
    serve_db.dispose()

    workers = [P.worker(tiny_llama_dir, url, logs, f"worker{i}", *ENGINE_FLAGS) for i in range(2)]
    serve = P.serve(tiny_llama_dir, logs, "serve", "--database-url", serve_url, *ENGINE_FLAGS,
                    *(a for name, path in tiny_adapters.items() for a in ("--adapter", f"{name}={path}")))
    # Gateways start with the workers: each waits for a worker to describe the model.
    metrics_port = P.free_port()
    gateways = [P.gateway(workers, url, logs, "gateway0", "--metrics-port", str(metrics_port)),
                P.gateway(workers, url, logs, "gateway1")]
    procs = [*workers, serve, *gateways]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        model = openai.OpenAI(base_url=gateways[0].url + "/v1", api_key=key).models.list().data[0].id
        yield Fleet(db, url, workers, gateways, serve, key, serve_key, digests, model, metrics_port)
    finally:
        for p in procs:
            try:
                p.stop()
            except RuntimeError:
                pass
        db.dispose()
