"""Admin credentials: the admin token, browser sessions signed with it, and CSRF tokens.

The admin token comes from (first found): `Settings.admin.token`, $LORAPLEX_ADMIN_TOKEN
(comma-separated to accept several while rotating), or the token `loraplex serve`
generates at first start, of which only the sha256 is kept, in
<data_dir>/admin-token.sha256 (mode 0600). With none of these the admin API answers 401
to everything and says how to configure a token.

Two ways in:

- API clients send `Authorization: Bearer <token>`. No cookie is involved, so no CSRF
  token is needed.
- The browser UI signs in once (POST /admin/api/session with the token) and gets a
  session cookie: HttpOnly, SameSite=Strict, Path=/admin, Secure under https (also
  behind a TLS-terminating proxy, when uvicorn trusts its X-Forwarded-Proto: see
  `--forwarded-allow-ips`). The cookie is signed with a random server secret kept in the
  database (admin/sessions.py), never with anything derived from the token, and names
  only a random session id; the session is a database row, so signing out on one
  replica ends it on all, and rotating the token ends the sessions signed in with it.
  Sessions last `SESSION_SECONDS`. Requests that change something with a session cookie
  must also send the session's CSRF token in the `X-CSRF-Token` header (double submit:
  the token is in a readable cookie and in the sign-in response); it is itself an HMAC
  of the session id, so a cookie planted by another site cannot forge it.

Failed sign-ins and wrong Bearer tokens are throttled per client address (429 with
Retry-After past a small burst); failed sign-ins are audited.

The audit log names who made a change: `token:<id>` or `session:<id>`, where a token's
<id> is an HMAC of its hash under the server secret (stable, and revealing nothing of
the token or its hash) and a session's <id> the start of its random id.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.admin.sessions import SessionTable, server_secret
from loraplex.platform.db.database import Database
from loraplex.platform.errors import AdminAuthenticationError as AuthenticationError
from loraplex.platform.errors import ConfigError, CsrfError, RateLimitedError
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.throttle import FailureThrottle, ThrottleConfig

ADMIN_TOKEN_ENV = "LORAPLEX_ADMIN_TOKEN"
TOKEN_FILE = "admin-token.sha256"
TOKEN_PREFIX = "lpxadmin_"
MIN_TOKEN_CHARS = 16
SESSION_COOKIE = "lpx_admin_session"
CSRF_COOKIE = "lpx_admin_csrf"
CSRF_HEADER = "x-csrf-token"
SESSION_SECONDS = 12 * 3600
COOKIE_PATH = "/admin"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass(frozen=True)
class Admin:
    """Who is calling: the token (by fingerprint) and, for a browser, the session."""

    token_id: str
    session_id: str | None = None
    session_expires: int | None = None
    csrf: str | None = None

    @property
    def actor(self) -> str:
        if self.session_id:
            return f"session:{self.session_id[:12]} (token:{self.token_id})"
        return f"token:{self.token_id}"


def token_file(settings: Settings) -> Path:
    return settings.data_dir / TOKEN_FILE


def configured_token_hashes(settings: Settings) -> tuple[list[str], str]:
    """(sha256 hex of every accepted admin token, where they came from)."""
    if settings.admin.token:
        tokens, source = [settings.admin.token], "settings"
    elif os.environ.get(ADMIN_TOKEN_ENV, "").strip():
        tokens, source = [t.strip() for t in os.environ[ADMIN_TOKEN_ENV].split(",") if t.strip()], f"${ADMIN_TOKEN_ENV}"
    else:
        path = token_file(settings)
        hashes = _read_token_file(path)
        return (hashes, str(path)) if hashes else ([], "none")
    for t in tokens:
        if len(t) < MIN_TOKEN_CHARS:
            raise ConfigError(f"the admin token from {source} is too short: use at least {MIN_TOKEN_CHARS} "
                              "random characters (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return [token_hash(t) for t in tokens], source


def _read_token_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        return []
    hashes = [x.lower() for x in lines if len(x) == 64 and all(c in "0123456789abcdefABCDEF" for c in x)]
    if not hashes:
        raise ConfigError(f"{path} holds no admin token hash; delete it to have a new token generated")
    return hashes


def new_admin_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def write_token_file(settings: Settings, token: str) -> Path:
    """Keep only the token's hash, readable by this user alone (atomic replace)."""
    path = token_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token_hash(token) + "\n")
    os.replace(tmp, path)
    return path


def ensure_admin_token(settings: Settings) -> str | None:
    """`loraplex serve` at first start: when no admin token is configured anywhere,
    generate one, keep its hash in the data dir and return it (to print once); else None."""
    hashes, _ = configured_token_hashes(settings)
    if hashes:
        return None
    token = new_admin_token()
    write_token_file(settings, token)
    return token


class AdminAuth:
    """Checks admin tokens and browser sessions; see the module docstring. Methods that
    touch sessions query the database: call them off the event loop."""

    def __init__(self, token_hashes: list[str], db: Database, source: str = "settings",
                 watch: Path | None = None, throttle: ThrottleConfig = ThrottleConfig()) -> None:
        secret = server_secret(db)
        self._id_key = hmac.new(secret, b"loraplex admin token id v2", hashlib.sha256).digest()
        self._session_key = hmac.new(secret, b"loraplex admin session v2", hashlib.sha256).digest()
        self._csrf_key = hmac.new(secret, b"loraplex admin csrf v2", hashlib.sha256).digest()
        self._sessions = SessionTable(db)
        self.throttle = FailureThrottle(throttle)
        self._tokens = self._entries(token_hashes)
        self.source = source
        # The generated token's file: re-read when it changes (`loraplex admin-token --reset`).
        self._watch = watch
        self._watch_stamp = self._stamp()

    @classmethod
    def from_settings(cls, settings: Settings, db: Database) -> AdminAuth:
        hashes, source = configured_token_hashes(settings)
        env_or_settings = bool(settings.admin.token or os.environ.get(ADMIN_TOKEN_ENV, "").strip())
        throttle = ThrottleConfig(burst=settings.auth.failure_burst, per_second=settings.auth.failure_rate)
        return cls(hashes, db, source, watch=None if env_or_settings else token_file(settings), throttle=throttle)

    def _entries(self, hashes: list[str]) -> dict[str, str]:
        """token id -> token hash."""
        return {hmac.new(self._id_key, h.encode(), hashlib.sha256).hexdigest()[:12]: h for h in hashes}

    def _stamp(self) -> tuple[int, int, int] | None:
        if self._watch is None:
            return None
        try:
            st = self._watch.stat()
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _refresh(self) -> None:
        if self._watch is None:
            return
        stamp = self._stamp()
        if stamp != self._watch_stamp:
            self._watch_stamp = stamp
            try:
                self._tokens = self._entries(_read_token_file(self._watch))
            except ConfigError:
                self._tokens = {}

    @property
    def configured(self) -> bool:
        self._refresh()
        return bool(self._tokens)

    def _no_token(self) -> AuthenticationError:
        return AuthenticationError(
            f"no admin token is configured: set ${ADMIN_TOKEN_ENV}, or start `loraplex serve` once to have "
            "one generated")

    def check_throttle(self, client: str | None) -> None:
        """429 for a client address that failed too often lately."""
        wait = self.throttle.retry_after(client) if client else 0.0
        if wait > 0:
            raise RateLimitedError("too many failed admin sign-in attempts from this address", wait)

    def check_token(self, token: str | None, client: str | None = None) -> Admin:
        self.check_throttle(client)
        self._refresh()
        if not self._tokens:
            raise self._no_token()
        digest = token_hash(token or "")
        match = None
        for tid, h in self._tokens.items():  # compare with every token: time does not depend on which matched
            if hmac.compare_digest(h, digest):
                match = tid
        if match is None or not token:
            if client:
                self.throttle.failed(client)
            raise AuthenticationError("invalid admin token")
        return Admin(match)

    # -- sessions ------------------------------------------------------------------------
    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._session_key, payload.encode(), hashlib.sha256).digest())

    def _csrf(self, sid: str) -> str:
        return _b64(hmac.new(self._csrf_key, sid.encode(), hashlib.sha256).digest())[:32]

    def new_session(self, admin: Admin, now: float | None = None) -> tuple[str, Admin]:
        """(cookie value, the session's Admin) for a caller that proved the token."""
        exp = int((now or time.time()) + SESSION_SECONDS)
        sid = self._sessions.create(admin.token_id, dt.datetime.fromtimestamp(exp, dt.timezone.utc))
        payload = f"v2.{sid}.{exp}"
        return f"{payload}.{self._sign(payload)}", Admin(admin.token_id, sid, exp, self._csrf(sid))

    def check_session(self, cookie: str, now: float | None = None) -> Admin:
        self._refresh()
        if not self._tokens:
            raise self._no_token()
        parts = cookie.split(".")
        if len(parts) != 4 or parts[0] != "v2":
            raise AuthenticationError("invalid admin session; sign in again")
        _, sid, exp_s, sig = parts
        if not hmac.compare_digest(self._sign(f"v2.{sid}.{exp_s}"), sig) or not (exp_s.isascii() and exp_s.isdigit()):
            raise AuthenticationError("invalid admin session; sign in again")
        exp = int(exp_s)
        if exp <= (now or time.time()):
            raise AuthenticationError("the admin session has expired; sign in again")
        state, token_id = self._sessions.status(sid)
        if state == "unknown":
            raise AuthenticationError("invalid admin session; sign in again")
        if state == "revoked":
            raise AuthenticationError("this admin session has been signed out; sign in again")
        if token_id not in self._tokens:
            raise AuthenticationError("this admin session was signed in with a token that is no longer accepted; "
                                      "sign in again")
        return Admin(token_id, sid, exp, self._csrf(sid))

    def sign_out(self, admin: Admin) -> None:
        """Revoke the session on every replica."""
        if admin.session_id:
            self._sessions.revoke(admin.session_id)

    # -- per request ---------------------------------------------------------------------
    def authenticate(self, method: str, authorization: str | None, cookie: str | None,
                     csrf_header: str | None, client: str | None = None) -> Admin:
        """The caller of one admin API request; raises 401 (who?), 403 (CSRF) or 429
        (`client` failed too often)."""
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationError("send the admin token as 'Authorization: Bearer <token>'")
            return self.check_token(token.strip(), client)
        if not cookie:
            self._refresh()
            if not self._tokens:
                raise self._no_token()
            raise AuthenticationError("admin token required: send 'Authorization: Bearer <token>' or sign in")
        admin = self.check_session(cookie)
        if method.upper() not in _SAFE_METHODS:
            if not csrf_header:
                raise CsrfError(f"CSRF token missing: send the session's token in the {CSRF_HEADER} header")
            if not hmac.compare_digest(csrf_header.encode(), (admin.csrf or "").encode()):
                raise CsrfError("CSRF token does not match this session; reload the page and sign in again")
        return admin
