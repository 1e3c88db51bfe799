"""vLLM's runtime LoRA calls, made with plain httpx exactly as vLLM's docs give them (with
the admin token where vLLM takes its --api-key), against a live server: the adapter is
validated, published and audited as an admin upload is, and tenants serve it at once."""
from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from loraplex.platform.tenancy.tenants import create_key, create_tenant
from tests.e2e.admin_fixtures import ADMIN_TOKEN, admin_live, upload_adapters  # noqa: F401 - fixtures

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"}


def _load(live, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/load_lora_adapter", json=body, headers=ADMIN if headers is None else headers,
                      timeout=60)


def _unload(live, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/unload_lora_adapter", json=body,
                      headers=ADMIN if headers is None else headers, timeout=60)


def _audit(live, action: str, target: str) -> dict:
    r = httpx.get(f"{live.url}/admin/api/audit", params={"action": action, "target": target}, headers=ADMIN,
                  timeout=30)
    rows = r.json()
    assert rows, f"no audit row for {action} {target}"
    return rows[0]


def _tenant(live) -> openai.OpenAI:
    name = f"t-{uuid.uuid4().hex[:6]}"
    create_tenant(live.db, name)
    return live.openai(create_key(live.db, name))


def test_load_serve_replace_and_unload(admin_live, upload_adapters):
    live, name = admin_live, f"sql-{uuid.uuid4().hex[:6]}"
    client = _tenant(live)
    r = _load(live, {"lora_name": name, "lora_path": str(upload_adapters["r4"])})
    assert r.status_code == 200, r.text
    assert r.text == f"Success: LoRA adapter '{name}' added successfully."
    assert name in [m.id for m in client.models.list().data]  # public, as on vLLM
    kw = dict(prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(model=name, **kw).choices[0].text
    base = client.completions.create(model=live.model, **kw).choices[0].text
    assert first != base
    row = _audit(live, "adapter.upload", f"adapter:{name}")
    assert row["details"]["via"] == "/v1/load_lora_adapter" and row["actor"].startswith("token:")
    digest = row["details"]["digest"]

    again = _load(live, {"lora_name": name, "lora_path": str(upload_adapters["r8"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert _load(live, {"lora_name": name, "lora_path": str(upload_adapters["r8"]), "load_inplace": True}
                 ).status_code == 200
    replaced = _audit(live, "adapter.replace", f"adapter:{name}")["details"]
    assert replaced["previous_digest"] == digest and replaced["digest"] != digest
    assert client.completions.create(model=name, **kw).choices[0].text != first  # the new version serves

    r = _unload(live, {"lora_name": name})
    assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' removed successfully."
    assert _audit(live, "adapter.remove", f"adapter:{name}")["details"]["via"] == "/v1/unload_lora_adapter"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=name, **kw)
    gone = _unload(live, {"lora_name": name})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]


def test_a_private_load_is_for_granted_tenants_only(admin_live, upload_adapters):
    live, name = admin_live, f"priv-{uuid.uuid4().hex[:6]}"
    assert _load(live, {"lora_name": name, "lora_path": str(upload_adapters["r4"]), "public": False}
                 ).status_code == 200
    assert name not in [m.id for m in _tenant(live).models.list().data]
    assert _unload(live, {"lora_name": name}).status_code == 200


def test_only_the_admin_token_may_call_them(admin_live, upload_adapters):
    live = admin_live
    name = f"t-{uuid.uuid4().hex[:6]}"
    create_tenant(live.db, name)
    tenant_key = create_key(live.db, name)
    body = {"lora_name": "nope", "lora_path": str(upload_adapters["r4"])}
    for headers in ({}, {"authorization": f"Bearer {tenant_key}"}, {"authorization": "Bearer wrong-token"}):
        assert _load(live, body, headers).status_code == 401
        assert _unload(live, {"lora_name": "nope"}, headers).status_code == 401
    assert _unload(live, {"lora_name": "nope"}).status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "../etc", "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "x1"}, "lora_path"),
    ({"lora_name": "x1", "lora_path": "/definitely/not/here"}, "lora_path"),
    ({"lora_name": "x1", "lora_path": "/tmp", "frobnicate": True}, "frobnicate"),
    ({"lora_name": "x1", "lora_path": "/tmp", "load_inplace": "yes"}, "load_inplace"),
])
def test_bad_loads_are_400s_naming_the_field(admin_live, body, param):
    r = _load(admin_live, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_folder_without_a_valid_adapter_is_refused(admin_live, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    r = _load(admin_live, {"lora_name": "broken", "lora_path": str(tmp_path)})
    assert r.status_code == 400, r.text
    assert httpx.get(f"{admin_live.url}/admin/api/adapters/broken", headers=ADMIN, timeout=30).status_code == 404
