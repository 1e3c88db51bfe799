"""Changes made with the CLI (an admin token reset among them), and billing exports, are in
the audit log as the admin API's are, naming the command line's user (SQLite and PostgreSQL)."""
from __future__ import annotations

from loraplex.platform.admin.auth import ADMIN_TOKEN_ENV, token_file, token_hash
from loraplex.platform.cli.commands import cli_actor
from loraplex.platform.db.database import Database, migrate
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy.audit import entries


def _log(url: str) -> list[tuple[str, str, dict, str]]:
    db = Database(url)
    try:
        with db.session() as s:
            return [(e.action, e.target, e.details, e.actor) for e in reversed(entries(s, limit=100))]
    finally:
        db.dispose()


def test_cli_mutations_and_exports_are_audited(cli, tmp_path, tiny_llama_dir, tiny_adapters):
    assert cli("tenant", "create", "acme", "--rpm", "60")[0] == 0
    assert cli("tenant", "update", "acme", "--weight", "2")[0] == 0
    assert cli("tenant", "update", "acme", "--tpm", "5000")[0] == 0
    key = cli("key", "create", "acme")[1].strip()
    prefix = key.split("_")[1]
    assert cli("tenant", "update", "acme", "--key", prefix, "--rpm", "5")[0] == 0
    assert cli("key", "revoke", prefix)[0] == 0
    assert cli("adapter", "add", "helper", str(tiny_adapters["ad1"]), "--public",
               "--model", str(tiny_llama_dir))[0] == 0
    assert cli("tenant", "list")[0] == 0  # reading changes nothing: not audited
    assert cli("usage", "export", "--from", "2026-01-15", "--to", "2026-01-16", "--tenant", "acme",
               "--output", str(tmp_path / "bill.csv"))[0] == 0
    rows = _log(cli.url)
    assert [(a, t) for a, t, _, _ in rows] == [
        ("tenant.create", "tenant:acme"), ("tenant.update", "tenant:acme"), ("quota.update", "tenant:acme"),
        ("key.create", f"key:lpx_{prefix}"), ("quota.update", f"key:lpx_{prefix}"),
        ("key.revoke", f"key:lpx_{prefix}"), ("adapter.upload", "adapter:helper"), ("usage.export", "tenant:acme")]
    assert {actor for *_, actor in rows} == {cli_actor()} and cli_actor().startswith("cli:")
    details = {a: d for a, _, d, _ in rows}
    assert details["tenant.create"]["quotas"] == {"rpm": 60} and details["tenant.update"] == {"weight": 2.0}
    assert details["adapter.upload"]["public"] is True and details["adapter.upload"]["digest"].startswith("sha256:")
    assert details["usage.export"]["format"] == "csv" and details["usage.export"]["records"] == 0
    assert key not in str(rows)  # never the secret


def test_an_admin_token_reset_is_audited(cli, tmp_path, monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)  # a token from the environment cannot be reset
    migrate(cli.url)  # a database in use: the log is empty, not missing, until the reset
    code, out, err = cli("admin-token", "--reset")
    assert code == 0, err
    token = out.strip()
    path = token_file(Settings(data_dir=tmp_path / "data"))
    assert path.read_text().strip() == token_hash(token)
    assert cli("admin-token")[0] == 0  # saying where the token comes from changes nothing: not audited
    rows = _log(cli.url)
    assert rows == [("admin_token.reset", "admin-token", {"token_file": str(path)}, cli_actor())]
    assert token not in str(rows) and token_hash(token) not in str(rows)  # neither the secret nor its hash
