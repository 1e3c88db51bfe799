"""`loraplex worker` and `loraplex migrate`: their arguments and refusals (no server runs here)."""
from __future__ import annotations

from sqlalchemy import create_engine, text

from loraplex.platform.cli.main import build_parser, settings_from_args
from tests.platform.fixtures import run_cli


def _head(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
    finally:
        engine.dispose()


def test_migrate_takes_the_url_from_the_flag_or_the_environment(capsys, tmp_path, monkeypatch):
    flag, env = f"sqlite:///{tmp_path / 'flag.db'}", f"sqlite:///{tmp_path / 'env.db'}"
    code, _, err = run_cli(capsys, "migrate", "--database-url", flag)
    assert code == 0 and "migrated" in err
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", env)
    code, _, _ = run_cli(capsys, "migrate")
    assert code == 0 and _head(env) == _head(flag)


def test_worker_takes_serves_engine_options():
    args = build_parser().parse_args(["worker", "--model", "/m", "--port", "9001", "--dtype", "float32",
                                      "--threads", "1", "--max-loras", "4", "--max-num-seqs", "16",
                                      "--adapter-store", "s3://bucket/prefix"])
    settings = settings_from_args(args)
    assert (args.port, args.host, args.adapter_store) == (9001, "127.0.0.1", "s3://bucket/prefix")
    assert settings.engine.lora.max_loras == 4 and settings.engine.scheduler.max_num_seqs == 16
    assert settings.engine.model.dtype == "float32" and settings.engine.num_threads == 1
    assert build_parser().parse_args(["worker"]).port == 8001


def test_worker_takes_the_observability_options_serve_and_gateway_take():
    argv = ["worker", "--log-format", "json", "--otlp-endpoint", "http://collector:4318/v1/traces"]
    settings = settings_from_args(build_parser().parse_args(argv))
    assert (settings.log_format, settings.otlp_endpoint) == ("json", "http://collector:4318/v1/traces")
    default = settings_from_args(build_parser().parse_args(["worker"]))
    assert (default.log_format, default.otlp_endpoint) == ("text", None)  # tracing off unless asked


def test_worker_refusals_name_the_problem(capsys, monkeypatch):
    monkeypatch.delenv("LORAPLEX_INTERNAL_TOKEN", raising=False)
    for argv, words in ((["--database-url", "sqlite://", "--adapter-store", "s3://b/p"], "not both"),
                        (["--adapter-store", "http://b/p"], "s3://bucket/prefix"),
                        (["--host", "0.0.0.0"], "LORAPLEX_INTERNAL_TOKEN")):
        code, _, err = run_cli(capsys, "worker", "--model", "/nowhere", *argv)
        assert code == 1 and words in err and "Traceback" not in err


def test_the_worker_reads_the_database_url_from_the_environment(monkeypatch):
    """What the chart does: the URL (and its password) in $LORAPLEX_DATABASE_URL, not in
    the worker's command line, where `ps` and /proc/PID/cmdline would show it."""
    from loraplex.platform.cli.roles import worker_config

    url = "postgresql+psycopg://loraplex:s3cret@db:5432/loraplex"
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", url)
    args = build_parser().parse_args(["worker", "--model", "/m", "--cache-dir", "/c"])
    assert worker_config(settings_from_args(args), args).adapter_store == url
    s3 = build_parser().parse_args(["worker", "--model", "/m", "--cache-dir", "/c", "--adapter-store", "s3://b/p"])
    assert worker_config(settings_from_args(s3), s3).adapter_store == "s3://b/p"  # the env URL is no conflict
