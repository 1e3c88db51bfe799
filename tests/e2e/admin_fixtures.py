"""A live loraplex server with the admin API enabled (one per database backend and test
module), over the e2e tests' shared tiny engine, and a client for the admin API that
checks every JSON response against the OpenAPI document the server publishes."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from sqlalchemy import update

from loraplex.platform.app import create_app
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.db.tables import Adapter
from loraplex.platform.settings import AdminConfig, Settings
from tests.e2e.conftest import LiveServer
from tests.platform.fixtures import BACKENDS, fresh_db_url

ADMIN_TOKEN = "test-admin-token-" + "x" * 24
UPLOAD_LIMIT = 4 << 20  # bytes; the tiny adapters are far below


class AdminClient:
    """httpx against /admin/api; checks each JSON answer against the published schema."""

    def __init__(self, url: str, doc: dict | None, token: str | None = ADMIN_TOKEN) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=f"{url}/admin/api", headers=headers, timeout=60)
        self.doc = doc
        self.csrf: str | None = None

    def close(self) -> None:
        self.http.close()

    def sign_in(self, token: str = ADMIN_TOKEN) -> httpx.Response:
        r = self.request("POST", "/session", json={"token": token})
        if r.status_code == 201:
            self.csrf = r.json()["csrf_token"]
        return r

    def request(self, method: str, path: str, *, csrf: bool = True, **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}) or {})
        if csrf and self.csrf and method not in ("GET", "HEAD"):
            headers.setdefault("x-csrf-token", self.csrf)
        r = self.http.request(method, path, headers=headers, **kw)
        if self.doc is not None:
            check_response(self.doc, method, path, r)
        return r

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.request("POST", path, **kw)

    def patch(self, path: str, **kw) -> httpx.Response:
        return self.request("PATCH", path, **kw)

    def put(self, path: str, **kw) -> httpx.Response:
        return self.request("PUT", path, **kw)

    def delete(self, path: str, **kw) -> httpx.Response:
        return self.request("DELETE", path, **kw)

    def audit(self, action: str | None = None, target: str | None = None) -> list[dict]:
        params = {k: v for k, v in (("action", action), ("target", target)) if v}
        r = self.get("/audit", params={**params, "limit": 1000})
        assert r.status_code == 200, r.text
        return r.json()


def _template(doc: dict, method: str, path: str) -> dict | None:
    path = path.split("?")[0]
    for template, item in doc["paths"].items():
        pattern = "^" + re.sub(r"{\w+}", "[^/]+", re.escape(template).replace(r"\{", "{").replace(r"\}", "}")) + "$"
        if re.match(pattern, "/admin/api" + path) and method.lower() in item:
            return item[method.lower()]
    return None


def check_response(doc: dict, method: str, path: str, r: httpx.Response) -> None:
    """The status is one the document lists for the operation, and a JSON body matches
    that status's schema."""
    op = _template(doc, method, path)
    if op is None:  # 404/405 on unknown routes
        return
    assert str(r.status_code) in op["responses"], f"{method} {path} -> {r.status_code}, undocumented: {r.text}"
    resp = op["responses"][str(r.status_code)]
    if "$ref" in resp:
        resp = doc["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    content = resp.get("content", {})
    if "application/json" in content and r.headers.get("content-type", "").startswith("application/json"):
        schema = {**content["application/json"]["schema"], "components": doc["components"]}
        jsonschema.Draft202012Validator(schema).validate(r.json())


@dataclass
class AdminLive:
    backend: str
    url: str
    model: str
    db: Database
    settings: Settings
    app: object
    engine: object
    doc: dict

    def client(self, token: str | None = ADMIN_TOKEN) -> AdminClient:
        return AdminClient(self.url, self.doc, token)

    def openai(self, key: str, base: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}{base or '/v1'}", api_key=key, max_retries=0, timeout=60)

    @property
    def store(self):
        return self.app.state.admin.store


@pytest.fixture(scope="module", params=BACKENDS)
def admin_live(request, tmp_path_factory, base_settings, tiny_engine, pg_schema_url) -> Iterator[AdminLive]:
    url = fresh_db_url(request.param, tmp_path_factory.mktemp("admin_db"), pg_schema_url)
    migrate(url)
    db = Database(url)
    # The engine's adapter store (under base_settings.data_dir) is the one uploads go to.
    settings = dataclasses.replace(base_settings, database_url=url,
                                   admin=AdminConfig(token=ADMIN_TOKEN, max_upload_bytes=UPLOAD_LIMIT),
                                   # every test sends wrong tokens from one address
                                   auth=dataclasses.replace(base_settings.auth, cache_ttl=30.0, failure_burst=100_000))
    app = create_app(settings, tiny_engine)
    with LiveServer(app) as server:
        doc = httpx.get(f"{server.url}/admin/api/openapi.json").json()
        yield AdminLive(request.param, server.url, settings.model_name, db, settings, app, tiny_engine, doc)
    db.dispose()


@pytest.fixture(scope="session")
def upload_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """PEFT adapters for uploads: two ranks, plus a zip of the first."""
    import shutil

    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("upload_adapters")
    out = {"r4": make_random_peft_adapter(tiny_llama_dir, root / "r4", rank=4, seed=11, init_scale=0.3,
                                          target_modules=["q_proj", "v_proj"]),
           "r8": make_random_peft_adapter(tiny_llama_dir, root / "r8", rank=8, seed=12, init_scale=0.3)}
    out["zip"] = Path(shutil.make_archive(str(root / "r4-zip"), "zip", out["r4"]))
    return out


# A prompt that meets the trainable tokens of `kind_adapters`' "saved" adapter.
KIND_PROMPT = [1523, 9041, 312, 27003, 15, 889, 4410]


@pytest.fixture(scope="session")
def kind_adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """Adapters of the kinds beyond plain LoRA that fit an upload: DoRA, lora_bias, and
    trainable tokens with saved norms."""
    from loraplex.adapters.synth import make_random_peft_adapter

    root = tmp_path_factory.mktemp("kind_uploads")
    kinds = (("dora", {"use_dora": True}), ("bias", {"lora_bias": True}),
             # KIND_PROMPT's tokens 1523, 312 and 15 are retrained; every RMSNorm is saved
             ("saved", {"trainable_token_indices": [15, 1523, 312],
                        "modules_to_save": ["input_layernorm", "post_attention_layernorm", "norm"]}))
    return {kind: make_random_peft_adapter(tiny_llama_dir, root / kind, rank=8, seed=31 + i, init_scale=0.3,
                                           lora_config=extra)
            for i, (kind, extra) in enumerate(kinds)}


def forget_kind(live: AdminLive, name: str) -> None:
    """Make `name` look recorded before kinds were: no kind in its registry row nor in this
    server's store index."""
    with live.db.session() as s:
        s.execute(update(Adapter).where(Adapter.name == name).values(features=None))
    path = live.store.root / "index.json"
    doc = json.loads(path.read_text())
    entry = doc["adapters"][name]
    for record in (entry["current"], *entry["history"]):
        record.pop("features", None)
    path.write_text(json.dumps(doc))


def adapter_files(folder: Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    """The multipart `files` parts of a PEFT folder."""
    return [("files", (p.name, p.read_bytes(), "application/octet-stream"))
            for p in (folder / "adapter_config.json", folder / "adapter_model.safetensors")]
