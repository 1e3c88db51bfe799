"""The pieces of a release find each other: the gateways' --workers-dns names the workers'
headless Service, probes hit the routes loraplex serves, references name objects and
ports that exist, and the hook Job runs the migration `loraplex serve` runs at start."""
from __future__ import annotations

import argparse
import ast
import importlib.util
from pathlib import Path

import pytest

from tests.helm.conftest import NAMESPACE

# The HTTP routes every loraplex role serves (liveness, readiness, Prometheus), as the
# chart's helpers name them ("loraplex.contract" in templates/_helpers.tpl).
ROUTES = {"liveness": "/health", "readiness": "/ready", "metrics": "/metrics"}
# The subcommands the chart runs.
COMMANDS = {"gateway", "worker", "serve", "migrate"}


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def _route_paths(package: str) -> set[str]:
    """The literal paths of every Starlette Route(...) in a loraplex package's source,
    read with ast: nothing is imported or started."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    paths = set()
    for folder in spec.submodule_search_locations:
        for file in Path(folder).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Route"
                        and node.args and isinstance(node.args[0], ast.Constant)):
                    paths.add(node.args[0].value)
    return paths


def test_the_probed_routes_are_served_by_loraplex():
    served = _route_paths("loraplex.platform")
    assert set(ROUTES.values()) <= served, f"loraplex.platform serves {sorted(served)}"


@pytest.mark.parametrize("values", [{}, {"cpuOnly": True}, {"worker": {"port": 9001}, "clusterDomain": "k8s.local"}])
def test_gateways_discover_the_workers_through_the_headless_service(render, values):
    out = render(values)
    headless = out.one("Service", "worker")
    worker = out.one("StatefulSet", "worker")
    assert headless["spec"]["clusterIP"] == "None"
    assert worker["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["selector"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    (port,) = [p for p in headless["spec"]["ports"] if p["name"] == "http"]  # the internal API's
    container_ports = {p["name"]: p["containerPort"] for p in _container(worker)["ports"]}
    assert container_ports[port["targetPort"]] == port["port"]
    assert _flag(_container(worker)["args"], "--port") == str(port["port"])

    dns = _flag(_container(out.one("Deployment", "gateway"))["args"], "--workers-dns")
    host, dns_port = dns.rsplit(":", 1)
    domain = values.get("clusterDomain", "cluster.local")
    assert host == f"{headless['metadata']['name']}.{NAMESPACE}.svc.{domain}"
    assert int(dns_port) == port["port"]


def test_services_select_their_pods_and_ports(render):
    out = render({"gateway": {"metricsPort": 9090}})
    gateway = out.one("Deployment", "gateway")
    svc = out.one("Service", "gateway")
    assert svc["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    names = {p["name"]: p["containerPort"] for p in _container(gateway)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(names)
    c = _container(gateway)
    assert _flag(c["args"], "--port") == str(names["http"]) and _flag(c["args"], "--metrics-port") == "9090"
    assert _flag(c["args"], "--metrics-host") == "0.0.0.0"  # the gateway's own default is loopback


def test_without_a_metrics_port_the_gateway_serves_metrics_where_it_is_scraped(render):
    out = render({"metrics": {"serviceMonitor": {"enabled": True}}, "gateway": {"metricsPort": None}})
    args = _container(out.one("Deployment", "gateway"))["args"]
    assert _flag(args, "--metrics-port") == "0"  # /metrics on the main port, not loopback:9464
    monitor = next(m for m in out.all("ServiceMonitor")
                   if m["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    for pdb in out.all("PodDisruptionBudget"):
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        owner = out.one("Deployment" if component == "gateway" else "StatefulSet", component)
        assert pdb["spec"]["selector"] == owner["spec"]["selector"]


def test_gateways_and_workers_get_the_same_log_format_and_tracing(render):
    def args(out) -> dict[str, list[str]]:
        return {role: _container(out.one(kind, role))["args"]
                for kind, role in (("Deployment", "gateway"), ("StatefulSet", "worker"))}

    for role, a in args(render()).items():
        assert _flag(a, "--log-format") == "text" and "--otlp-endpoint" not in a, role  # tracing off
    endpoint = "http://otel-collector.monitoring:4318/v1/traces"
    for role, a in args(render({"observability": {"logFormat": "json", "otlpEndpoint": endpoint}})).items():
        assert (_flag(a, "--log-format"), _flag(a, "--otlp-endpoint")) == ("json", endpoint), role


def test_probes_hit_the_contract_routes_on_the_serving_port(render):
    out = render()
    for doc, role in ((out.one("Deployment", "gateway"), "gateway"), (out.one("StatefulSet", "worker"), "worker")):
        c = _container(doc)
        assert c["livenessProbe"]["httpGet"] == {"path": ROUTES["liveness"], "port": "http"}, role
        assert c["readinessProbe"]["httpGet"] == {"path": ROUTES["readiness"], "port": "http"}, role
        assert "http" in {p["name"] for p in c["ports"]}
    assert _container(out.one("StatefulSet", "worker"))["startupProbe"]["httpGet"]["path"] == ROUTES["liveness"]


def test_the_migration_hook_runs_loraplex_migrate_before_the_roles_start(render):
    for values, hook in (({}, "post-install,pre-upgrade"),
                         ({"postgresql": {"enabled": False}, "database": {"url": "postgresql://db/x"}},
                          "pre-install,pre-upgrade")):
        out = render(values)
        job = out.one("Job")
        assert job["metadata"]["annotations"]["helm.sh/hook"] == hook
        c = _container(job)
        assert c["args"] == ["migrate"]  # the database URL comes from the env, not the command line
        env = {e["name"]: e for e in c["env"]}
        secret_ref = env["LORAPLEX_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
        assert secret_ref["key"] in out.named("Secret", secret_ref["name"])["data"]
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_every_secret_reference_exists(render):
    out = render()
    secrets = {s["metadata"]["name"]: s for s in out.all("Secret")}
    for doc in out.all("Deployment") + out.all("StatefulSet") + out.all("Job"):
        for c in doc["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["data"], (doc["metadata"]["name"], e["name"])
            if "$(" in " ".join(c.get("args", [])):
                defined = {e["name"] for e in c.get("env", [])}
                for arg in c["args"]:
                    if arg.startswith("$("):
                        assert arg[2:-1] in defined


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from loraplex.platform.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_cli_has_every_command_the_chart_runs():
    assert COMMANDS <= set(_subcommands())


# The worker's device flags (--device, --gpu-memory-utilization) come with the GPU worker.
_WORKER_PENDING = not {"--device", "--gpu-memory-utilization"} <= set(_subcommands()["worker"]._option_string_actions)
_ROLES = {"gateway": ("Deployment", "gateway"), "worker": ("StatefulSet", "worker"), "migrate": ("Job", None)}


@pytest.mark.parametrize("role", sorted(_ROLES))
@pytest.mark.parametrize("values", [{}, {"cpuOnly": True}, {"adapterStore": {"type": "s3", "s3": {"bucket": "b"}}},
                                    {"gateway": {"metricsPort": 9090}},
                                    {"observability": {"logFormat": "json", "otlpEndpoint": "http://otel:4318/v1/traces"}}])
def test_loraplex_cli_accepts_the_rendered_arguments(render, values, role, request):
    from loraplex.platform.cli.main import build_parser

    if role == "worker" and _WORKER_PENDING:
        request.applymarker(pytest.mark.xfail(strict=True, raises=SystemExit,
                                              reason="`loraplex worker --device/--gpu-memory-utilization` "
                                                     "come with the GPU worker"))
    out = render(values)
    doc = out.one(*_ROLES[role]) if _ROLES[role][1] else out.one(_ROLES[role][0])
    args = [a.replace("$(LORAPLEX_DATABASE_URL)", "postgresql+psycopg://u@db/x") for a in _container(doc)["args"]]
    assert build_parser().parse_args(args).command == role


def test_loraplex_migrate_is_the_migration_serve_runs(tmp_path):
    from sqlalchemy import create_engine, inspect, text

    from loraplex.platform.cli.main import build_parser, main
    from loraplex.platform.db import migrate  # what `loraplex serve` runs at start

    by_hook, by_serve = f"sqlite:///{tmp_path}/hook.db", f"sqlite:///{tmp_path}/serve.db"
    build_parser().parse_args(["migrate", "--database-url", by_hook])
    with pytest.raises(SystemExit) as done:
        main(["migrate", "--database-url", by_hook])
    assert done.value.code == 0
    migrate(by_serve)

    def schema(url: str) -> tuple:
        engine = create_engine(url)
        try:
            insp = inspect(engine)
            tables = {t: sorted(c["name"] for c in insp.get_columns(t)) for t in insp.get_table_names()}
            with engine.connect() as conn:
                head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            return tables, head
        finally:
            engine.dispose()

    assert schema(by_hook) == schema(by_serve)
