"""topology=pool: `loraplex serve` replicas on the shared database and adapter store as the
members of a Gateway API Inference Extension InferencePool (validated against the GAIE v1
CRD's own schema), and, in every topology, each port a pod, probe, Service or pool names
is one its process listens on, read from the process's rendered arguments with loraplex's
own command-line parser."""
from __future__ import annotations

import copy
import ipaddress

import helm_python as helm
import jsonschema
import pytest

from tests.helm.crd_schemas import validate_crd

POOL = {"topology": "pool", "inferencePool": {"endpointPicker": {"name": "lpx-epp"}}}


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def _parse(args: list[str]):
    from loraplex.platform.cli.main import build_parser

    return build_parser().parse_args([a.replace("$(LORAPLEX_DATABASE_URL)", "postgresql+psycopg://u@db/x")
                                      for a in args])


def _listening(container: dict) -> set[int]:
    """The ports the container's process listens on at an address other pods reach."""
    if container["image"].startswith("postgres:"):
        return {5432}  # PostgreSQL's default: the chart passes it no port
    args = _parse(container["args"])
    ports = set()
    for host, port in ((getattr(args, "host", None), getattr(args, "port", None)),
                       (getattr(args, "metrics_host", None), getattr(args, "metrics_port", None))):
        if port and host is not None and not ipaddress.ip_address(host).is_loopback:
            ports.add(port)
    return ports


def _pod_templates(out) -> list[dict]:
    return [d for kind in ("Deployment", "StatefulSet", "Job") for d in out.all(kind)]


def _resolve(container: dict, port) -> int:
    """A port as a probe or Service names it (a number, or a container port's name)."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"{container['name']} has no port named {port}"
    return named[port]


def _selected(out, selector: dict) -> list[dict]:
    return [d for d in _pod_templates(out)
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]


@pytest.mark.parametrize("values", [
    {}, {"cpuOnly": True}, {"gateway": {"metricsPort": 9090}, "metrics": {"serviceMonitor": {"enabled": True}}},
    {"worker": {"port": 9001}}, POOL, {**POOL, "cpuOnly": True, "metrics": {"serviceMonitor": {"enabled": True}}},
    {**POOL, "pool": {"port": 9000, "service": {"port": 8080}}},
])
def test_every_port_named_is_one_its_process_listens_on(render, values):
    out = render(values)
    for doc in _pod_templates(out):
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if not c.get("ports") and not c.get("readinessProbe"):
                continue  # the migration Job: nothing listens
            listening = _listening(c)
            for p in c.get("ports", []):
                assert p["containerPort"] in listening, (doc["metadata"]["name"], p, listening)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    action = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                    if action is not None:  # an exec probe names no port
                        assert _resolve(c, action["port"]) in listening, (doc["metadata"]["name"], probe)
    for svc in out.all("Service"):
        pods = _selected(out, svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for doc in pods:
            for p in svc["spec"]["ports"]:
                c = _container(doc)
                assert _resolve(c, p.get("targetPort", p["port"])) in _listening(c), (svc["metadata"]["name"], p)
    for monitor in out.all("ServiceMonitor"):
        services = [s for s in out.all("Service")
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert services, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for svc in services:
            named = {p.get("name") for p in svc["spec"]["ports"]}
            assert {e["port"] for e in monitor["spec"]["endpoints"]} <= named, (monitor["metadata"]["name"], named)
    for pool in out.all("InferencePool"):
        pods = _selected(out, pool["spec"]["selector"]["matchLabels"])
        assert pods and all(_component(d) == "pool" for d in pods)
        for doc in pods:
            args = _parse(_container(doc)["args"])
            # A pool member speaks OpenAI (serve) and has /metrics on the port the picker scrapes.
            assert args.command == "serve" and args.metrics_port == 0
            assert {p["number"] for p in pool["spec"]["targetPorts"]} <= _listening(_container(doc))


def test_pool_topology_is_serve_replicas_behind_the_inference_pool(render):
    out = render({**POOL, "pool": {"replicaCount": 3, "servedModelName": "llama-8b"},
                  "worker": {"engine": {"maxLoras": 16}}})
    assert {_component(d) for d in _pod_templates(out)} == {"pool", "migrate", "postgresql"}
    assert not [s for s in out.all("Service") if _component(s) in ("gateway", "worker")]
    members = out.one("Deployment", "pool")
    assert members["spec"]["replicas"] == 3
    c = _container(members)
    args = _parse(c["args"])
    assert (args.command, args.host, args.port, args.served_model_name) == ("serve", "0.0.0.0", 8000, "llama-8b")
    assert args.no_demo and args.max_loras == 16 and args.database_url is None  # from the env: out of argv
    assert args.forwarded_allow_ips == "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16"  # the inference gateway's proxies
    env = {e["name"]: e for e in c["env"]}
    assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_ADMIN_TOKEN"} <= set(env)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and args.device == "cuda"
    assert c["image"].endswith("-cuda")
    pool = out.one("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= members["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "lpx-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    pdb = out.one("PodDisruptionBudget")
    assert _component(pdb) == "pool" and pdb["spec"]["selector"] == members["spec"]["selector"]


def test_pool_members_share_the_s3_adapter_store(render):
    out = render({**POOL, "adapterStore": {"type": "s3", "s3": {"bucket": "lpx", "existingSecret": "s3-creds"}}})
    c = _container(out.one("Deployment", "pool"))
    assert _parse(c["args"]).adapter_store == "s3://lpx/adapters"
    assert {"secretRef": {"name": "s3-creds"}} in c["envFrom"]


def test_fleet_topology_refuses_an_inference_pool_over_its_workers(chart):
    with pytest.raises(helm.HelmError, match="the fleet's workers serve only loraplex's internal API"):
        chart.render({"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}},
                     name="lpx", namespace="serving")


@pytest.mark.parametrize("gateway", [{"ingress": {"enabled": True}}, {"autoscaling": {"enabled": True}}])
def test_gateway_values_in_a_pool_are_refused_not_ignored(chart, gateway):
    with pytest.raises(helm.HelmError, match="belong to topology=fleet"):
        chart.render({**POOL, "gateway": gateway}, name="lpx", namespace="serving")


def test_the_gaie_crd_schema_refuses_what_the_api_server_would(render):
    good = render(POOL).one("InferencePool")
    validate_crd(good)

    def bad(edit) -> dict:
        doc = copy.deepcopy(good)
        edit(doc["spec"])
        return doc

    for doc in (bad(lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}])),  # CEL: unique ports
                bad(lambda s: s["endpointPickerRef"].pop("port")),                            # CEL: a Service's port
                bad(lambda s: s.update(targetPorts=[])),
                bad(lambda s: s.update(targetPorts=[{"number": 70000}])),
                bad(lambda s: s.update(extensionRef={"name": "epp"})),                         # pre-v1 field name
                bad(lambda s: s["selector"]["matchLabels"].update(tier="a b")),
                bad(lambda s: s.update(appProtocol="grpc"))):
        with pytest.raises(jsonschema.ValidationError):
            validate_crd(doc)
    kind_elsewhere = bad(lambda s: s["endpointPickerRef"].update(kind="Backend", group="example.com"))
    kind_elsewhere["spec"]["endpointPickerRef"].pop("port")
    validate_crd(kind_elsewhere)  # the port rule binds Services only


def test_pool_network_policies_admit_the_inference_gateway_and_reach_postgresql(render):
    out = render(POOL)
    policies = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in out.all("NetworkPolicy")}
    assert set(policies) == {"pool", "postgresql"}
    members = out.one("Deployment", "pool")["spec"]["template"]["metadata"]["labels"]
    assert policies["pool"]["spec"]["podSelector"]["matchLabels"].items() <= members.items()
    (rule,) = policies["pool"]["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}] and "from" not in rule  # gatewayFrom: anyone
    (pg_rule,) = policies["postgresql"]["spec"]["ingress"]
    assert any(p["podSelector"]["matchLabels"].items() <= members.items() for p in pg_rule["from"])
    gateway_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference-gateway"}}}
    (rule,) = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in render(
        {**POOL, "networkPolicy": {"gatewayFrom": [gateway_ns]}}).all("NetworkPolicy")}["pool"]["spec"]["ingress"]
    assert rule["from"][0] == gateway_ns and {"namespaceSelector": {}} in rule["from"]  # and the scrapers
