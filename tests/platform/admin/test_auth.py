"""Admin credentials without a server: tokens from settings, the environment or the
generated token's file; sessions signed with the server secret and kept in the
database; CSRF; sign-in throttling; `loraplex admin-token`."""
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
from loraplex.platform.admin.sessions import server_secret
from loraplex.platform.db.database import Database
from loraplex.platform.errors import AdminAuthenticationError, ConfigError, CsrfError, RateLimitedError
from loraplex.platform.settings import AdminConfig, Settings

TOKEN = "a-long-enough-admin-token-0123"


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)


def test_bearer_token_and_wrong_ones(db):
    auth = AdminAuth([token_hash(TOKEN)], db)
    admin = auth.authenticate("POST", f"Bearer {TOKEN}", None, None)  # no CSRF needed with a token
    # The fingerprint is keyed by the server secret: nothing of the token's hash shows.
    assert admin.actor.startswith("token:") and token_hash(TOKEN)[:6] not in admin.actor
    assert AdminAuth([token_hash(TOKEN)], db).check_token(TOKEN).token_id == admin.token_id  # stable
    for header in (f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}", "Bearer lpx_0123456789ab_x"):
        with pytest.raises(AdminAuthenticationError):
            auth.authenticate("GET", header, None, None)
    with pytest.raises(AdminAuthenticationError, match="admin token required"):
        auth.authenticate("GET", None, None, None)
    with pytest.raises(AdminAuthenticationError, match="no admin token is configured"):
        AdminAuth([], db).authenticate("GET", f"Bearer {TOKEN}", None, None)


def test_server_secret_is_random_generated_once_and_shared(db):
    first = server_secret(db)
    assert len(first) == 32 and server_secret(db) == first
    assert server_secret(Database(db.url)) == first  # another replica reads the same one
    assert bytes.fromhex(token_hash(TOKEN)) != first


def test_sessions_are_signed_expire_and_need_csrf_for_changes(db):
    auth = AdminAuth([token_hash(TOKEN)], db)
    cookie, session = auth.new_session(auth.check_token(TOKEN))
    assert session.actor.startswith("session:") and session.csrf
    assert token_hash(TOKEN)[:8] not in cookie and token_hash(TOKEN)[:8] not in session.actor
    assert auth.authenticate("GET", None, cookie, None).session_id == session.session_id
    with pytest.raises(CsrfError):
        auth.authenticate("POST", None, cookie, None)
    with pytest.raises(CsrfError):
        auth.authenticate("DELETE", None, cookie, "x" * 32)
    assert auth.authenticate("PATCH", None, cookie, session.csrf).session_id == session.session_id
    # Tampering with any part breaks the signature.
    v, sid, exp, sig = cookie.split(".")
    for forged in (f"{v}.{sid}.{int(exp) + 999}.{sig}", f"{v}.{'0' * 32}.{exp}.{sig}",
                   f"{v}.{sid}.{exp}.{sig[:-2]}AA", f"{v}.{sid}.²{exp}.{sig}", "garbage", ""):
        with pytest.raises(AdminAuthenticationError):
            auth.check_session(forged)
    # A CSRF token belongs to its session only.
    cookie2, session2 = auth.new_session(auth.check_token(TOKEN))
    with pytest.raises(CsrfError):
        auth.authenticate("POST", None, cookie2, session.csrf)
    # Expiry, and sign-out, which another replica (its own AdminAuth) sees at once.
    with pytest.raises(AdminAuthenticationError, match="expired"):
        auth.check_session(cookie, now=session.session_expires + 1)
    assert session.session_expires - SESSION_SECONDS <= auth.check_session(cookie).session_expires
    replica = AdminAuth([token_hash(TOKEN)], Database(db.url))
    assert replica.check_session(cookie).session_id == session.session_id
    auth.sign_out(session)
    for a in (auth, replica):
        with pytest.raises(AdminAuthenticationError, match="signed out"):
            a.check_session(cookie)
    assert replica.check_session(cookie2).session_id == session2.session_id


def test_a_copy_of_the_token_hash_mints_no_session(db):
    """The old scheme's key was derived from the hash: that key verifies nothing now."""
    import base64
    import hashlib
    import hmac

    auth = AdminAuth([token_hash(TOKEN)], db)
    cookie, _ = auth.new_session(auth.check_token(TOKEN))
    v, sid, exp, _sig = cookie.split(".")
    key = hmac.new(bytes.fromhex(token_hash(TOKEN)), b"loraplex admin session v2", hashlib.sha256).digest()
    sig = base64.urlsafe_b64encode(hmac.new(key, f"v2.{sid}.{exp}".encode(), hashlib.sha256).digest())
    with pytest.raises(AdminAuthenticationError):
        auth.check_session(f"{v}.{sid}.{exp}.{sig.rstrip(b'=').decode()}")


def test_rotating_the_token_ends_its_sessions(db):
    auth = AdminAuth([token_hash(TOKEN)], db)
    cookie, _ = auth.new_session(auth.check_token(TOKEN))
    with pytest.raises(AdminAuthenticationError, match="no longer accepted"):
        AdminAuth([token_hash(TOKEN + "-other")], db).check_session(cookie)


def test_failed_tokens_are_throttled_per_client(db):
    auth = AdminAuth([token_hash(TOKEN)], db)
    for _ in range(auth.throttle.config.burst):
        with pytest.raises(AdminAuthenticationError):
            auth.check_token("wrong-" + TOKEN, client="10.0.0.1")
    with pytest.raises(RateLimitedError) as err:
        auth.check_token(TOKEN, client="10.0.0.1")  # even the right token waits
    assert err.value.retry_after > 0
    assert auth.check_token(TOKEN, client="10.0.0.2").token_id  # other clients are unaffected
    assert auth.check_token(TOKEN).token_id


def test_token_sources(tmp_path, monkeypatch, db):
    s = Settings(data_dir=tmp_path)
    assert AdminAuth.from_settings(s, db).configured is False
    with pytest.raises(ConfigError, match="too short"):
        AdminAuth.from_settings(Settings(data_dir=tmp_path, admin=AdminConfig(token="short")), db)
    monkeypatch.setenv(ADMIN_TOKEN_ENV, f"{TOKEN}, {TOKEN}-next")  # two while rotating
    auth = AdminAuth.from_settings(s, db)
    assert auth.check_token(TOKEN) and auth.check_token(f"{TOKEN}-next")
    assert ensure_admin_token(s) is None  # the environment's token counts: nothing generated
    assert not token_file(s).exists()
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    # Settings win over the environment.
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    assert AdminAuth.from_settings(Settings(data_dir=tmp_path, admin=AdminConfig(token=TOKEN + "-s")), db).check_token(TOKEN + "-s")
    with pytest.raises(AdminAuthenticationError):
        AdminAuth.from_settings(Settings(data_dir=tmp_path, admin=AdminConfig(token=TOKEN + "-s")), db).check_token(TOKEN)


def test_generated_token_once_hash_only_and_reset_applies_at_once(tmp_path, db):
    s = Settings(data_dir=tmp_path)
    token = ensure_admin_token(s)
    assert token and token.startswith("lpxadmin_") and len(token) > 40
    assert ensure_admin_token(s) is None  # only at first start
    path = token_file(s)
    assert path.read_text().strip() == token_hash(token) and token not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = AdminAuth.from_settings(s, db)
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
    assert shown.returncode == 0 and token_hash(new)[:8] not in shown.stdout and new not in shown.stdout
