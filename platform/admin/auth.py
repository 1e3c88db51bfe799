"""Admin credentials: the admin token, browser sessions signed with it, and CSRF tokens.

The admin token comes from (first found): `Settings.admin_token`, $LORAPLEX_ADMIN_TOKEN
(comma-separated to accept several while rotating), or the token `loraplex serve`
generates at first start, of which only the sha256 is kept, in
<data_dir>/admin-token.sha256 (mode 0600). With none of these the admin API answers 401
to everything and says how to configure a token.

Two ways in:

- API clients send `Authorization: Bearer <token>`. No cookie is involved, so no CSRF
  token is needed.
- The browser UI signs in once (POST /admin/api/session with the token) and gets a
  session cookie: HttpOnly, SameSite=Strict, Path=/admin, Secure under https. Sessions
  are stateless (HMAC-signed with a key derived from the token's hash, so every replica
  accepts them and rotating the token ends them) and last `SESSION_SECONDS`. Requests
  that change something with a session cookie must also send the session's CSRF token
  in the `X-CSRF-Token` header (double submit: the token is in a readable cookie and in
  the sign-in response); it is itself an HMAC of the session id, so a cookie planted by
  another site cannot forge it.

The audit log names who made a change: `token:<id>` or `session:<id>` (where <id> is a
short non-secret fingerprint) plus, for sessions, the token they were signed in with.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.platform.errors import AdminAuthenticationError as AuthenticationError
from loraplex.platform.errors import ConfigError, CsrfError
from loraplex.platform.settings import Settings

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
            return f"session:{self.session_id} (token:{self.token_id})"
        return f"token:{self.token_id}"


@dataclass(frozen=True)
class _Token:
    hash: str
    id: str
    key: bytes  # session-signing key


def _token_entry(digest: str) -> _Token:
    return _Token(digest, digest[:12], hmac.new(bytes.fromhex(digest), b"loraplex admin session v1",
                                                hashlib.sha256).digest())


def token_file(settings: Settings) -> Path:
    return settings.data_dir / TOKEN_FILE


def configured_token_hashes(settings: Settings) -> tuple[list[str], str]:
    """(sha256 hex of every accepted admin token, where they came from)."""
    if settings.admin_token:
        tokens, source = [settings.admin_token], "settings"
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
    """Checks admin tokens and browser sessions; see the module docstring."""

    def __init__(self, token_hashes: list[str], source: str = "settings", watch: Path | None = None) -> None:
        self._tokens = [_token_entry(h) for h in token_hashes]
        self.source = source
        self._signed_out: dict[str, int] = {}  # session id -> its expiry (this process)
        # The generated token's file: re-read when it changes (`loraplex admin-token --reset`).
        self._watch = watch
        self._watch_stamp = self._stamp()

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminAuth:
        hashes, source = configured_token_hashes(settings)
        env_or_settings = bool(settings.admin_token or os.environ.get(ADMIN_TOKEN_ENV, "").strip())
        return cls(hashes, source, watch=None if env_or_settings else token_file(settings))

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
                self._tokens = [_token_entry(h) for h in _read_token_file(self._watch)]
            except ConfigError:
                self._tokens = []

    @property
    def configured(self) -> bool:
        self._refresh()
        return bool(self._tokens)

    def _no_token(self) -> AuthenticationError:
        return AuthenticationError(
            f"no admin token is configured: set ${ADMIN_TOKEN_ENV}, or start `loraplex serve` once to have "
            "one generated")

    def check_token(self, token: str | None) -> Admin:
        self._refresh()
        if not self._tokens:
            raise self._no_token()
        digest = token_hash(token or "")
        match = None
        for t in self._tokens:  # compare with every token: time does not depend on which matched
            if hmac.compare_digest(t.hash, digest):
                match = t
        if match is None or not token:
            raise AuthenticationError("invalid admin token")
        return Admin(match.id)

    # -- sessions ------------------------------------------------------------------------
    def new_session(self, admin: Admin, now: float | None = None) -> tuple[str, Admin]:
        """(cookie value, the session's Admin) for a caller that proved the token."""
        t = self._by_id(admin.token_id)
        sid = secrets.token_hex(8)
        exp = int((now or time.time()) + SESSION_SECONDS)
        payload = f"v1.{t.id}.{sid}.{exp}"
        cookie = f"{payload}.{_b64(hmac.new(t.key, payload.encode(), hashlib.sha256).digest())}"
        return cookie, Admin(t.id, sid, exp, self._csrf(t, sid))

    def _by_id(self, token_id: str) -> _Token:
        for t in self._tokens:
            if t.id == token_id:
                return t
        raise AuthenticationError("this admin session was signed in with a token that is no longer accepted; "
                                  "sign in again")

    @staticmethod
    def _csrf(t: _Token, sid: str) -> str:
        return _b64(hmac.new(t.key, f"csrf.{sid}".encode(), hashlib.sha256).digest())[:32]

    def check_session(self, cookie: str, now: float | None = None) -> Admin:
        self._refresh()
        if not self._tokens:
            raise self._no_token()
        parts = cookie.split(".")
        if len(parts) != 5 or parts[0] != "v1":
            raise AuthenticationError("invalid admin session; sign in again")
        _, tid, sid, exp_s, sig = parts
        t = self._by_id(tid)
        want = _b64(hmac.new(t.key, f"v1.{tid}.{sid}.{exp_s}".encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(want, sig) or not exp_s.isdigit():
            raise AuthenticationError("invalid admin session; sign in again")
        exp = int(exp_s)
        if exp <= (now or time.time()):
            raise AuthenticationError("the admin session has expired; sign in again")
        if sid in self._signed_out:
            raise AuthenticationError("this admin session has been signed out; sign in again")
        return Admin(tid, sid, exp, self._csrf(t, sid))

    def sign_out(self, admin: Admin) -> None:
        if admin.session_id and admin.session_expires:
            now = time.time()
            for sid, exp in list(self._signed_out.items()):
                if exp <= now:
                    del self._signed_out[sid]
            self._signed_out[admin.session_id] = admin.session_expires

    # -- per request ---------------------------------------------------------------------
    def authenticate(self, method: str, authorization: str | None, cookie: str | None,
                     csrf_header: str | None) -> Admin:
        """The caller of one admin API request; raises 401 (who?) or 403 (CSRF)."""
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise AuthenticationError("send the admin token as 'Authorization: Bearer <token>'")
            return self.check_token(token.strip())
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
