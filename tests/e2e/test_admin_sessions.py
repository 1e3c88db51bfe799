"""Admin sessions on a live server: Secure behind a TLS-terminating proxy, nothing of the
token's hash in cookies or audit rows, failed sign-ins audited, sign-out final."""
from __future__ import annotations

import httpx

from loraplex.platform.admin.auth import token_hash
from loraplex.platform.settings import AdminConfig
from tests.e2e.admin_fixtures import ADMIN_TOKEN, admin_live  # noqa: F401 - fixtures


def _sign_in(url: str, token: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/api/session", json={"token": token}, headers=headers, timeout=60)


def test_cookie_is_secure_when_a_trusted_proxy_says_https(admin_live):  # noqa: F811
    # The live server trusts 127.0.0.1 (uvicorn's forwarded_allow_ips default).
    proxied = _sign_in(admin_live.url, ADMIN_TOKEN, **{"x-forwarded-proto": "https"})
    plain = _sign_in(admin_live.url, ADMIN_TOKEN)
    assert proxied.status_code == plain.status_code == 201
    assert all("secure" in c.lower() for c in proxied.headers.get_list("set-cookie"))
    assert not any("secure" in c.lower() for c in plain.headers.get_list("set-cookie"))


def test_no_part_of_the_token_hash_in_cookies_or_audit(admin_live):  # noqa: F811
    r = _sign_in(admin_live.url, ADMIN_TOKEN)
    digest = token_hash(ADMIN_TOKEN)
    shown = " ".join(r.headers.get_list("set-cookie")) + r.text
    audit = httpx.get(f"{admin_live.url}/admin/api/audit", params={"limit": 1000},
                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60).text
    for i in range(0, 64 - 8):
        assert digest[i:i + 8] not in shown and digest[i:i + 8] not in audit


def test_failed_sign_ins_are_audited(admin_live):  # noqa: F811
    assert _sign_in(admin_live.url, "wrong-" + ADMIN_TOKEN).status_code == 401
    rows = httpx.get(f"{admin_live.url}/admin/api/audit", params={"action": "session.failed"},
                     headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60).json()
    assert rows and rows[0]["actor"] == "anonymous" and rows[0]["target"].startswith("client:")


def test_sign_out_ends_the_session(admin_live):  # noqa: F811
    with httpx.Client(base_url=f"{admin_live.url}/admin/api", timeout=60) as browser:
        r = browser.post("/session", json={"token": ADMIN_TOKEN})
        csrf = r.json()["csrf_token"]
        cookie = browser.cookies.get("lpx_admin_session")
        assert browser.get("/session").status_code == 200
        assert browser.delete("/session", headers={"x-csrf-token": csrf}).status_code == 204
    replay = httpx.get(f"{admin_live.url}/admin/api/session", cookies={"lpx_admin_session": cookie}, timeout=60)
    assert replay.status_code == 401 and "signed out" in replay.json()["error"]["message"]


def test_secure_cookies_marks_the_cookie_secure_behind_a_proxy_it_does_not_trust(
        tmp_path, base_settings, tiny_engine):
    """`--secure-cookies` (what the chart sets behind its TLS Ingress): Secure without any
    X-Forwarded-Proto, since the Ingress controller is not a trusted proxy."""
    import dataclasses

    from loraplex.platform.app import create_app
    from loraplex.platform.db.database import migrate
    from tests.e2e.conftest import LiveServer

    url = f"sqlite:///{tmp_path / 'secure.db'}"
    migrate(url)
    settings = dataclasses.replace(base_settings, database_url=url, admin=AdminConfig(token=ADMIN_TOKEN),
                                   secure_cookies=True, forwarded_allow_ips="")
    with LiveServer(create_app(settings, tiny_engine)) as server:
        r = _sign_in(server.url, ADMIN_TOKEN)
    cookies = r.headers.get_list("set-cookie")
    assert r.status_code == 201 and len(cookies) == 2 and all("secure" in c.lower() for c in cookies)
