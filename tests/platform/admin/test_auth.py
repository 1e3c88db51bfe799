"""Admin credentials without a server: tokens from settings, the environment or the
generated token's file; signed sessions; CSRF; `loraplex admin-token`."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from loraplex.platform.admin.auth import (
    ADMIN_TOKEN_ENV,
    SESSION_SECONDS,
    AdminAuth,
    ensure_admin_token,
    token_file,
    token_hash,
)
from loraplex.platform.errors import AdminAuthenticationError, ConfigError, CsrfError
from loraplex.platform.settings import Settings

TOKEN = "a-long-enough-admin-token-0123"


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)


def test_bearer_token_and_wrong_ones():
    auth = AdminAuth([token_hash(TOKEN)])
    admin = auth.authenticate("POST", f"Bearer {TOKEN}", None, None)  # no CSRF needed with a token
    assert admin.actor == f"token:{token_hash(TOKEN)[:12]}"
    for header in (f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", "Bearer lpx_0123456789ab_x"):
        with pytest.raises(AdminAuthenticationError):
            auth.authenticate("GET", header, None, None)
    with pytest.raises(AdminAuthenticationError, match="admin token required"):
        auth.authenticate("GET", None, None, None)
    with pytest.raises(AdminAuthenticationError, match="no admin token is configured"):
        AdminAuth([]).authenticate("GET", f"Bearer {TOKEN}", None, None)


def test_sessions_are_signed_expire_and_need_csrf_for_changes():
    auth = AdminAuth([token_hash(TOKEN)])
    cookie, session = auth.new_session(auth.check_token(TOKEN))
    assert session.actor.startswith("session:") and session.csrf
    assert auth.authenticate("GET", None, cookie, None).session_id == session.session_id
    with pytest.raises(CsrfError):
        auth.authenticate("POST", None, cookie, None)
    with pytest.raises(CsrfError):
        auth.authenticate("DELETE", None, cookie, "x" * 32)
    assert auth.authenticate("PATCH", None, cookie, session.csrf).session_id == session.session_id
    # Tampering with any part breaks the signature; another token's key does not verify it.
    v, tid, sid, exp, sig = cookie.split(".")
    for forged in (f"{v}.{tid}.{sid}.{int(exp) + 999}.{sig}", f"{v}.{tid}.{'0' * 16}.{exp}.{sig}",
                   f"{v}.{tid}.{sid}.{exp}.{sig[:-2]}AA", "garbage", ""):
        with pytest.raises(AdminAuthenticationError):
            auth.check_session(forged)
    other = AdminAuth([token_hash(TOKEN + "-other")])
    with pytest.raises(AdminAuthenticationError):
        other.check_session(cookie)
    # A CSRF token belongs to its session only.
    cookie2, session2 = auth.new_session(auth.check_token(TOKEN))
    with pytest.raises(CsrfError):
        auth.authenticate("POST", None, cookie2, session.csrf)
    # Expiry, and sign-out.
    with pytest.raises(AdminAuthenticationError, match="expired"):
        auth.check_session(cookie, now=session.session_expires + 1)
    assert session.session_expires - SESSION_SECONDS <= auth.check_session(cookie).session_expires
    auth.sign_out(session)
    with pytest.raises(AdminAuthenticationError, match="signed out"):
        auth.check_session(cookie)
    assert auth.check_session(cookie2).session_id == session2.session_id


def test_token_sources(tmp_path, monkeypatch):
    s = Settings(data_dir=tmp_path)
    assert AdminAuth.from_settings(s).configured is False
    with pytest.raises(ConfigError, match="too short"):
        AdminAuth.from_settings(Settings(data_dir=tmp_path, admin_token="short"))
    monkeypatch.setenv(ADMIN_TOKEN_ENV, f"{TOKEN}, {TOKEN}-next")  # two while rotating
    auth = AdminAuth.from_settings(s)
    assert auth.check_token(TOKEN) and auth.check_token(f"{TOKEN}-next")
    assert ensure_admin_token(s) is None  # the environment's token counts: nothing generated
    assert not token_file(s).exists()
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    # Settings win over the environment.
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    assert AdminAuth.from_settings(Settings(data_dir=tmp_path, admin_token=TOKEN + "-s")).check_token(TOKEN + "-s")
    with pytest.raises(AdminAuthenticationError):
        AdminAuth.from_settings(Settings(data_dir=tmp_path, admin_token=TOKEN + "-s")).check_token(TOKEN)


def test_generated_token_once_hash_only_and_reset_applies_at_once(tmp_path):
    s = Settings(data_dir=tmp_path)
    token = ensure_admin_token(s)
    assert token and token.startswith("lpxadmin_") and len(token) > 40
    assert ensure_admin_token(s) is None  # only at first start
    path = token_file(s)
    assert path.read_text().strip() == token_hash(token) and token not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = AdminAuth.from_settings(s)
    cookie, _ = auth.new_session(auth.check_token(token))
    # `loraplex admin-token --reset`: stdout is the new token alone.
    env = {k: v for k, v in os.environ.items() if k != ADMIN_TOKEN_ENV}
    out = subprocess.run([sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "admin-token",
                          "--reset", "--data-dir", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert new.startswith("lpxadmin_") and new != token
    assert auth.check_token(new)  # the running server's AdminAuth re-reads the file
    with pytest.raises(AdminAuthenticationError):
        auth.check_token(token)
    with pytest.raises(AdminAuthenticationError):
        auth.check_session(cookie)  # sessions of the old token end with it
    shown = subprocess.run([sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "admin-token",
                            "--data-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0 and token_hash(new)[:12] in shown.stdout and new not in shown.stdout
