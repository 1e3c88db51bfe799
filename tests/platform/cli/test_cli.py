"""The `loraplex` CLI's management commands, on SQLite and PostgreSQL."""
from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.platform.cli.main import parse_size
from tests.platform.fixtures import run_cli
from loraplex.platform.tenancy.tenants import KEY_RE




def test_tenants_and_keys(cli):
    assert cli("tenant", "create", "acme", "--lane", "interactive")[0] == 0
    assert cli("tenant", "create", "beta")[0] == 0
    code, out, err = cli("key", "create", "acme")
    assert code == 0 and KEY_RE.fullmatch(out.strip()) and out.count("\n") == 1  # only the key
    key = out.strip()
    code, out, _ = cli("tenant", "list")
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["acme", "interactive"] and lines[1].split()[-1] == "1"
    assert lines[2].split()[:2] == ["beta", "standard"]
    assert cli("key", "revoke", key.split("_")[1])[0] == 0
    assert cli("tenant", "list")[1].splitlines()[1].split()[-1] == "0"


@pytest.mark.parametrize("argv, message", [
    (("tenant", "create", "bad name"), "invalid tenant name"),
    (("tenant", "create", "x", "--lane", "turbo"), "unknown lane"),
    (("key", "create", "nobody"), "no tenant named 'nobody'"),
    (("key", "revoke", "000000000000"), "no API key with prefix"),
    (("adapter", "add", "a", "/does/not/exist", "--public"), "does not exist"),
])
def test_errors_are_one_line_not_tracebacks(cli, argv, message):
    code, out, err = cli(*argv)
    assert code == 1 and message in err and "Traceback" not in err
    assert err.startswith("loraplex: error: ")


def test_duplicate_tenant(cli):
    cli("tenant", "create", "acme")
    code, _, err = cli("tenant", "create", "acme")
    assert code == 1 and "already exists" in err


def test_adapters(cli, tiny_llama_dir, tiny_adapters):
    cli("tenant", "create", "acme")
    cli("tenant", "create", "beta")
    model = ("--model", str(tiny_llama_dir))
    assert cli("adapter", "add", "pub", str(tiny_adapters["ad1"]), "--public", *model)[0] == 0
    assert cli("adapter", "add", "priv", str(tiny_adapters["ad2"]), "--owner", "acme", "--grant", "beta",
               *model)[0] == 0
    code, _, err = cli("adapter", "add", "pub", str(tiny_adapters["ad2"]), *model)
    assert code == 1 and "already exists" in err
    assert cli("adapter", "add", "pub", str(tiny_adapters["ad3"]), "--replace", *model)[0] == 0
    code, _, err = cli("adapter", "add", "x", str(tiny_adapters["ad1"]), "--grant", "nobody", *model)
    assert code == 1 and "nobody" in err
    code, out, _ = cli("adapter", "list")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["pub"][1] == "public" and rows["priv"][1:4] == ["private", "acme", "beta"]
    assert set(rows) == {"pub", "priv"}


def test_bad_database_url_is_a_clean_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "tenant", "list", "--database-url", "mysql://nope/x", "--data-dir", str(tmp_path))
    assert code == 1 and "unsupported database" in err


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000


def test_console_script_prints_help():
    proc = subprocess.run([sys.executable, "-c", "from loraplex.platform.cli.main import main; main()", "--help"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "serve" in proc.stdout and "adapter" in proc.stdout


def test_tenant_weight_and_request_timeout(cli):
    from loraplex.platform.db.database import Database
    from loraplex.platform.tenancy.tenants import tenant_info

    code, out, _ = cli("tenant", "create", "heavy", "--weight", "3", "--request-timeout", "45")
    assert code == 0 and "weight 3, request timeout 45 s" in out
    assert cli("tenant", "create", "light")[0] == 0
    lines = cli("tenant", "list")[1].splitlines()
    assert lines[0].split()[-3:] == ["WEIGHT", "TIMEOUT", "KEYS"]
    assert lines[1].split()[0] == "heavy" and lines[1].split()[-3:] == ["3", "45s", "0"]
    assert lines[2].split()[-3:] == ["1", "-", "0"]
    code, out, _ = cli("tenant", "update", "heavy", "--weight", "0.5", "--request-timeout", "none")
    assert code == 0 and "weight 0.5, request timeout the server's" in out
    db = Database(cli.url)
    try:
        info = tenant_info(db, "heavy")
        assert (info.weight, info.request_timeout) == (0.5, None)
        assert "weight 0.5" in cli("tenant", "show", "heavy")[1]
        # A quota update leaves the scheduling fields as they are.
        assert cli("tenant", "update", "heavy", "--rpm", "10")[0] == 0
        assert tenant_info(db, "heavy").weight == 0.5
    finally:
        db.dispose()


@pytest.mark.parametrize("argv, message", [
    (("tenant", "create", "x", "--weight", "0"), "weight must be a number > 0"),
    (("tenant", "create", "x", "--weight", "nan"), "weight must be a finite number"),
    (("tenant", "create", "x", "--weight", "5000"), "<= 1000"),
    (("tenant", "create", "x", "--request-timeout", "-3"), "seconds must be a finite number >= 0"),
    (("tenant", "update", "nobody", "--weight", "2"), "no tenant named 'nobody'"),
    (("tenant", "update", "acme", "--key", "0123456789ab", "--weight", "2"), "per tenant, not per key"),
    (("tenant", "update", "acme"), "nothing to change: give --weight"),
])
def test_bad_scheduling_values_are_one_line_errors(cli, argv, message):
    cli("tenant", "create", "acme")
    code, out, err = cli(*argv)
    assert code != 0 and message in err and "Traceback" not in err


def test_serve_flags_reach_the_settings():
    from loraplex.platform.cli.main import build_parser, settings_from_args

    def settings(*argv):
        return settings_from_args(build_parser().parse_args(["serve", "--data-dir", "/tmp/x", *argv]))

    s = settings()
    assert (s.engine.scheduler.scheduling, s.request_timeout, s.log_format, s.otlp_endpoint) == \
        ("fair", None, "text", None)
    s = settings("--scheduling", "fcfs", "--request-timeout", "30", "--log-format", "json",
                 "--otlp-endpoint", "http://127.0.0.1:4318/v1/traces")
    assert (s.engine.scheduler.scheduling, s.request_timeout, s.log_format, s.otlp_endpoint) == \
        ("fcfs", 30.0, "json", "http://127.0.0.1:4318/v1/traces")
    for bad in (["--scheduling", "lottery"], ["--request-timeout", "soon"], ["--log-format", "xml"]):
        with pytest.raises(SystemExit):
            settings(*bad)


def test_speculative_config_reads_vllms_json():
    from loraplex.engine.config import SpeculativeConfig
    from loraplex.platform.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'])
    assert args.speculative_config == SpeculativeConfig("ngram", 3, prompt_lookup_max=5)
    assert build_parser().parse_args(["serve"]).speculative_config == SpeculativeConfig()


@pytest.mark.parametrize("value, message", [
    ("{", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"method": "eagle"}', "unknown speculative method"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "not supported between"),
    ('{"methd": "ngram"}', "unknown keys"),
])
def test_bad_speculative_config_is_named(capsys, value, message):
    from loraplex.platform.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", value])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err
