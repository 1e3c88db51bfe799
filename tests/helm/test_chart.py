"""The chart lints, and each documented deployment renders to valid manifests that do what
helm/README.md says (every render is validated in conftest.render)."""
from __future__ import annotations

import base64

import helm_python as helm
import pytest

from tests.helm.conftest import CHART, NAMESPACE, RELEASE

GPU = "nvidia.com/gpu"


def _container(doc: dict) -> dict:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_lint_is_clean():
    report = helm.lint(str(CHART), strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_defaults(render):
    out = render()
    assert out.kinds() == sorted([
        "Deployment", "Job", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget",
        "PodDisruptionBudget", "Secret", "Secret", "Service", "Service", "Service", "ServiceAccount", "StatefulSet",
        "StatefulSet"])
    gateway = out.one("Deployment", "gateway")
    assert gateway["spec"]["replicas"] == 2
    worker = out.one("StatefulSet", "worker")
    c = _container(worker)
    assert c["image"].endswith("-cuda") and _flag(c["args"], "--device") == "cuda"
    assert c["resources"]["limits"][GPU] == 1 and c["resources"]["requests"][GPU] == 1
    # The built-in PostgreSQL: the database URL in the Secret points at its Service.
    secret = out.named("Secret", f"{RELEASE}-loraplex")
    url = base64.b64decode(secret["data"]["database-url"]).decode()
    pg = out.one("Service", "postgresql")
    assert f"@{pg['metadata']['name']}.{NAMESPACE}.svc.cluster.local:5432/loraplex" in url
    password = base64.b64decode(secret["data"]["postgres-password"]).decode()
    assert f":{password}@" in url
    # The model comes from the PVC, read-only; nothing in the pod downloads it.
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "loraplex-models", "readOnly": True}
    assert _flag(c["args"], "--model") == "/models/model"
    for doc in (gateway, worker):
        env = _env(_container(doc))
        assert env["HF_HUB_OFFLINE"]["value"] == "1" and env["TRANSFORMERS_OFFLINE"]["value"] == "1"
    assert "is deployed" in out.notes


def test_cpu_only(render):
    out = render({"cpuOnly": True, "worker": {"engine": {"threads": 4}},
                  "model": {"source": "image", "path": "default"}})
    worker = out.one("StatefulSet", "worker")
    c = _container(worker)
    assert c["image"].endswith("-cpu")
    assert _flag(c["args"], "--device") == "cpu" and _flag(c["args"], "--threads") == "4"
    assert "--gpu-memory-utilization" not in c["args"]
    assert not any(GPU in r for r in c["resources"].values())
    spec = worker["spec"]["template"]["spec"]
    assert "tolerations" not in spec
    assert "model" not in {v["name"] for v in spec["volumes"]} and _flag(c["args"], "--model") == "default"
    assert "CPU only" in out.notes


def test_three_gateways_four_gpu_workers(render):
    out = render({
        "gateway": {"replicaCount": 3, "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12}},
        "worker": {"replicaCount": 4, "gpusPerWorker": 1, "nodeSelector": {"gpu": "h100"},
                   "runtimeClassName": "nvidia",
                   "engine": {"maxNumSeqs": 256, "maxNumBatchedTokens": 8192, "maxModelLen": 8192,
                              "gpuMemoryUtilization": 0.85, "maxLoras": 16, "maxLoraRank": 32}},
    })
    worker = out.one("StatefulSet", "worker")
    assert worker["spec"]["replicas"] == 4
    spec = worker["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["runtimeClassName"] == "nvidia"
    assert spec["tolerations"] == [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    args = _container(worker)["args"]
    assert {f: _flag(args, f) for f in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                                        "--gpu-memory-utilization", "--max-loras", "--max-lora-rank")} == {
        "--max-num-seqs": "256", "--max-num-batched-tokens": "8192", "--max-model-len": "8192",
        "--gpu-memory-utilization": "0.85", "--max-loras": "16", "--max-lora-rank": "32"}
    # An autoscaled Deployment leaves replicas to the HPA.
    assert "replicas" not in out.one("Deployment", "gateway")["spec"]
    hpa = out.one("HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["scaleTargetRef"]["name"] == out.one("Deployment", "gateway")["metadata"]["name"]
    assert "4 x" in out.notes


def test_speculative_decoding_reaches_every_worker_as_loraplex_reads_it(render):
    from loraplex.engine.config import SpeculativeConfig
    from loraplex.platform.cli.options import speculative_config_arg

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}
    args = _container(render({"worker": {"engine": {"speculativeConfig": spec}}}).one("StatefulSet", "worker"))["args"]
    assert speculative_config_arg(_flag(args, "--speculative-config")) == SpeculativeConfig("ngram", 3, 5)
    default = _container(render({}).one("StatefulSet", "worker"))["args"]
    assert "--speculative-config" not in default


def test_external_postgresql_with_existing_secret(render):
    out = render({"postgresql": {"enabled": False}, "secrets": {"existingSecret": "loraplex-prod"}})
    assert out.all("Secret") == [] and out.all("StatefulSet") == [out.one("StatefulSet", "worker")]
    for doc in (out.one("Deployment", "gateway"), out.one("StatefulSet", "worker"), out.one("Job")):
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in _container(doc)["env"] if "valueFrom" in e}
        assert refs == {"loraplex-prod"}
    # The database exists before the release: migrate before install as well as upgrade.
    assert out.one("Job")["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"


def test_external_postgresql_by_url(render):
    url = "postgresql+psycopg://lpx:s3cret@db.internal:5432/loraplex"
    out = render({"postgresql": {"enabled": False}, "database": {"url": url},
                  "secrets": {"adminToken": "a" * 32, "internalToken": "i" * 32}})
    main, migrate = out.named("Secret", f"{RELEASE}-loraplex"), out.named("Secret", f"{RELEASE}-loraplex-migrate")
    decoded = {k: base64.b64decode(v).decode() for k, v in main["data"].items()}
    assert decoded == {"admin-token": "a" * 32, "internal-token": "i" * 32, "database-url": url}
    assert base64.b64decode(migrate["data"]["database-url"]).decode() == url
    # The hook's Secret exists before the hook Job and is gone once it succeeded.
    ann = migrate["metadata"]["annotations"]
    assert ann["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(ann["helm.sh/hook-weight"]) < int(out.one("Job")["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert "hook-succeeded" in ann["helm.sh/hook-delete-policy"]
    assert not any(d["metadata"]["labels"].get("app.kubernetes.io/component") == "postgresql" for d in out.docs)


def test_s3_adapter_store(render):
    out = render({"adapterStore": {"type": "s3", "s3": {
        "bucket": "lpx-adapters", "prefix": "prod/", "endpointUrl": "http://minio.storage:9000",
        "region": "us-east-1", "existingSecret": "s3-creds"}}})
    for doc in (out.one("Deployment", "gateway"), out.one("StatefulSet", "worker")):
        c = _container(doc)
        assert _flag(c["args"], "--adapter-store") == "s3://lpx-adapters/prod"
        env = _env(c)
        assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
        assert env["AWS_DEFAULT_REGION"]["value"] == "us-east-1"
        assert {"secretRef": {"name": "s3-creds"}} in c["envFrom"]
    assert "--database-url" not in _container(out.one("StatefulSet", "worker"))["args"]


def test_ingress_service_monitor_and_operator_knobs(render):
    out = render({
        "imagePullSecrets": [{"name": "regcred"}],
        "gateway": {"metricsPort": 9090, "extraEnv": [{"name": "LORAPLEX_DEBUG", "value": "1"}],
                    "service": {"type": "LoadBalancer", "annotations": {"lb.example.com/internal": "true"}},
                    "ingress": {"enabled": True, "className": "nginx",
                                "tls": [{"secretName": "lpx-tls", "hosts": ["loraplex.example.com"]}]}},
        "worker": {"extraArgs": ["--max-cpu-loras", "64"]},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    })
    svc = out.one("Service", "gateway")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"] == {"lb.example.com/internal": "true"}
    ingress = out.one("Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": svc["metadata"]["name"], "port": {"number": svc["spec"]["ports"][0]["port"]}}
    gw = _container(out.one("Deployment", "gateway"))
    assert _flag(gw["args"], "--metrics-port") == "9090" and _env(gw)["LORAPLEX_DEBUG"]["value"] == "1"
    assert _container(out.one("StatefulSet", "worker"))["args"][-2:] == ["--max-cpu-loras", "64"]
    for doc in out.all("Deployment") + out.all("StatefulSet") + out.all("Job"):
        if doc["metadata"]["labels"]["app.kubernetes.io/component"] != "postgresql":
            assert doc["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    monitors = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in out.all("ServiceMonitor")}
    assert set(monitors) == {"gateway", "worker"}
    assert monitors["gateway"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitors["worker"]["spec"]["endpoints"][0]["port"] == "metrics"  # off the internal API's port
    # A worker's /metrics is behind the internal token: the scrape sends it from the Secret.
    auth = monitors["worker"]["spec"]["endpoints"][0]["authorization"]
    secret = out.named("Secret", auth["credentials"]["name"])
    assert auth["type"] == "Bearer" and auth["credentials"]["key"] == "internal-token" in secret["data"]
    assert "authorization" not in monitors["gateway"]["spec"]["endpoints"][0]
    # Behind the TLS Ingress the admin cookie is Secure (the controller is no trusted proxy).
    assert "--secure-cookies" in gw["args"]
    assert all(m["metadata"]["labels"]["release"] == "prometheus" for m in monitors.values())


PRIVATE_RANGES = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16"


def test_the_gateway_trusts_the_ingress_for_client_addresses(render, chart):
    """Behind the Ingress every client would share its pods' address (one throttle and one
    connection cap for all tenants) unless the gateway believes their X-Forwarded-For."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    gw = _container(render({"gateway": {"ingress": {"enabled": True}}}).one("Deployment", "gateway"))
    trusted = _flag(gw["args"], "--forwarded-allow-ips")
    assert trusted == PRIVATE_RANGES
    hosts = ProxyHeadersMiddleware(None, trusted_hosts=trusted).trusted_hosts  # what uvicorn makes of it
    assert "10.244.1.7" in hosts and "8.8.8.8" not in hosts
    with pytest.raises(Exception, match="forwardedAllowIps"):
        chart.validate_schema({"gateway": {"forwardedAllowIps": ["ingress pods"]}})


def test_without_a_proxy_the_gateway_trusts_none_by_default(render):
    """No Ingress, no proxy: a trusted peer would skip the per-address connection cap and
    name any client address it likes in X-Forwarded-For."""
    for values in ({}, {"gateway": {"forwardedAllowIps": None}}):
        assert "--forwarded-allow-ips" not in _container(render(values).one("Deployment", "gateway"))["args"]


@pytest.mark.parametrize("ingress", [False, True])
def test_an_explicit_list_of_trusted_proxies_is_used_as_given(render, ingress):
    def args(ips: list[str]) -> list[str]:
        values = {"gateway": {"forwardedAllowIps": ips, "ingress": {"enabled": ingress}}}
        return _container(render(values).one("Deployment", "gateway"))["args"]

    assert _flag(args(["10.244.0.0/16"]), "--forwarded-allow-ips") == "10.244.0.0/16"
    assert _flag(args(["10.244.0.0/16", "fd00::/8"]), "--forwarded-allow-ips") == "10.244.0.0/16,fd00::/8"
    assert "--forwarded-allow-ips" not in args([])  # [] trusts none, even behind the Ingress


def test_no_secret_on_a_command_line(render):
    """The database URL (with its password) reaches every role as an env var from the
    Secret, never as an argument (`ps`, /proc/PID/cmdline)."""
    for values in ({}, {"postgresql": {"enabled": False}, "database": {"url": "postgresql://u:pw@db/x"}},
                   {"adapterStore": {"type": "s3", "s3": {"bucket": "b"}}}):
        out = render(values)
        for doc in (out.one("Deployment", "gateway"), out.one("StatefulSet", "worker"), out.one("Job")):
            c = _container(doc)
            assert "--database-url" not in c["args"] and not any("$(" in a or "pw@" in a for a in c["args"])
            assert "secretKeyRef" in _env(c)["LORAPLEX_DATABASE_URL"]["valueFrom"]


def test_metrics_are_off_the_tenant_port_by_default(render):
    out = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    gw = _container(out.one("Deployment", "gateway"))
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert _flag(gw["args"], "--metrics-port") == str(ports["metrics"]) != str(ports["http"])
    monitor = next(m for m in out.all("ServiceMonitor") if m["metadata"]["labels"]["app.kubernetes.io/component"]
                   == "gateway")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert "--secure-cookies" not in gw["args"]  # no TLS Ingress: the cookie follows the request's scheme


def _policy(out, component: str) -> dict:
    return next(p for p in out.all("NetworkPolicy") if p["metadata"]["labels"]["app.kubernetes.io/component"]
                == component)


def test_network_policies(render):
    out = render()
    labels = {c: doc["spec"]["template"]["metadata"]["labels"] for c, doc in (
        ("gateway", out.one("Deployment", "gateway")), ("worker", out.one("StatefulSet", "worker")),
        ("migrate", out.one("Job")), ("postgresql", out.one("StatefulSet", "postgresql")))}

    def selects(peer: dict, component: str) -> bool:
        return "podSelector" in peer and peer["podSelector"]["matchLabels"].items() <= labels[component].items()

    for component in ("gateway", "worker", "postgresql"):
        policy = _policy(out, component)
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels[component].items()
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    gateway_rules = {r["ports"][0]["port"]: r for r in _policy(out, "gateway")["spec"]["ingress"]}
    assert "from" not in gateway_rules["http"]  # the public API
    assert gateway_rules["metrics"]["from"] == [{"namespaceSelector": {}}]  # in-cluster only
    worker_rules = {r["ports"][0]["port"]: r for r in _policy(out, "worker")["spec"]["ingress"]}
    assert worker_rules["http"]["ports"] == [{"port": "http", "protocol": "TCP"}]
    (peer,) = worker_rules["http"]["from"]  # the internal API: the gateways only
    assert selects(peer, "gateway") and not selects(peer, "worker")
    assert worker_rules["metrics"]["from"] == [{"namespaceSelector": {}}]  # the scrapers, on /metrics only
    (pg_rule,) = _policy(out, "postgresql")["spec"]["ingress"]
    assert pg_rule["ports"] == [{"port": "postgresql", "protocol": "TCP"}]
    for component in ("gateway", "worker", "migrate"):
        assert any(selects(p, component) for p in pg_rule["from"])
    assert not any(selects(p, "postgresql") for p in pg_rule["from"])
    # Narrowed by values; the external-database release has no PostgreSQL policy.
    ingress_ns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    out = render({"networkPolicy": {"gatewayFrom": [ingress_ns]}, "postgresql": {"enabled": False},
                  "database": {"url": "postgresql://db/x"}})
    rules = {r["ports"][0]["port"]: r for r in _policy(out, "gateway")["spec"]["ingress"]}
    assert rules["http"]["from"] == [ingress_ns]
    assert len(out.all("NetworkPolicy")) == 2
    assert render({"networkPolicy": {"enabled": False}}).all("NetworkPolicy") == []


def test_the_workers_internal_api_is_closed_to_the_scrapers(render):
    """A worker's /metrics on a port of its own: metricsFrom reaches that port only, and the
    internal API's port admits the gateways and workerFrom alone."""
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "bench"}}}
    out = render({"networkPolicy": {"metricsFrom": scrapers, "workerFrom": [peer]},
                  "metrics": {"serviceMonitor": {"enabled": True}}})
    worker = _container(out.one("StatefulSet", "worker"))
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert _flag(worker["args"], "--metrics-port") == str(ports["metrics"]) == "9464" != str(ports["http"])
    assert _flag(worker["args"], "--metrics-host") == "0.0.0.0"  # the worker's own default is loopback
    svc_ports = {p["name"]: p for p in out.one("Service", "worker")["spec"]["ports"]}
    assert svc_ports["metrics"]["targetPort"] == "metrics" and svc_ports["http"]["targetPort"] == "http"
    rules = {r["ports"][0]["port"]: r for r in _policy(out, "worker")["spec"]["ingress"]}
    assert set(rules) == {"http", "metrics"}
    assert rules["http"]["from"][1:] == [peer] and scrapers[0] not in rules["http"]["from"]
    assert rules["http"]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert rules["metrics"]["from"] == scrapers
    monitor = next(m for m in out.all("ServiceMonitor")
                   if m["metadata"]["labels"]["app.kubernetes.io/component"] == "worker")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["authorization"]["type"] == "Bearer"
    assert "the workers' port 9464" in out.notes


def test_without_a_worker_metrics_port_metrics_stay_on_the_http_port(render, chart):
    scrapers = [{"namespaceSelector": {}}]
    out = render({"worker": {"metricsPort": None}, "metrics": {"serviceMonitor": {"enabled": True}}})
    worker = _container(out.one("StatefulSet", "worker"))
    assert "--metrics-port" not in worker["args"] and [p["name"] for p in worker["ports"]] == ["http"]
    assert [p["name"] for p in out.one("Service", "worker")["spec"]["ports"]] == ["http"]
    (rule,) = _policy(out, "worker")["spec"]["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}] and rule["from"][1:] == scrapers
    monitor = next(m for m in out.all("ServiceMonitor")
                   if m["metadata"]["labels"]["app.kubernetes.io/component"] == "worker")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    with pytest.raises(Exception, match="must differ from worker.port"):
        chart.render({"worker": {"metricsPort": 8001}}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_a_stopping_gateway_drains_its_usage_journal(render, chart):
    out = render()
    gw = out.one("Deployment", "gateway")
    assert _flag(_container(gw)["args"], "--usage-drain-timeout") == "240"
    assert gw["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 240 + 30
    with pytest.raises(helm.HelmError, match="must exceed 30 s of request draining plus gateway.usageDrainSeconds"):
        chart.render({"gateway": {"terminationGracePeriodSeconds": 120}}, name=RELEASE, namespace=NAMESPACE)
    # Or a shared ReadWriteMany claim for the journals: any gateway replays a stopped one's.
    gw = render({"gateway": {"journal": {"existingClaim": "lpx-journals"}}}).one("Deployment", "gateway")
    mounts = {m["name"]: m["mountPath"] for m in _container(gw)["volumeMounts"]}
    volumes = {v["name"]: v for v in gw["spec"]["template"]["spec"]["volumes"]}
    assert mounts["journal"] == "/var/lib/loraplex/usage-journal"
    assert volumes["journal"]["persistentVolumeClaim"] == {"claimName": "lpx-journals"}


def test_the_adapter_cache_is_bounded_below_the_cache_volume(render, chart):
    from loraplex.platform.cli.options import cache_size_arg

    def bound_and_volume(values: dict | None = None) -> tuple[str | None, str]:
        worker = render(values).one("StatefulSet", "worker")
        volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
        return _flag(_container(worker)["args"], "--adapter-cache-size"), volumes["cache"]["emptyDir"]["sizeLimit"]

    assert bound_and_volume() == ("16Gi", "20Gi")
    assert bound_and_volume({"worker": {"cacheSize": "100Gi", "adapterCacheSize": "80Gi"}}) == ("80Gi", "100Gi")
    assert bound_and_volume({"worker": {"adapterCacheSize": "20G"}}) == ("20G", "20Gi")  # 2e10 < 20 x 2^30
    # The worker reads the quantity as the kubelet reads the volume's: Gi is 2^30, G is 10^9.
    assert (cache_size_arg("16Gi"), cache_size_arg("20G")) == (16 * 2**30, 20 * 10**9)
    for values in ({"adapterCacheSize": "20Gi"}, {"cacheSize": "16Gi"}, {"cacheSize": "8Gi"},
                   {"adapterCacheSize": "1.5Gi", "cacheSize": "1536Mi"}):
        with pytest.raises(helm.HelmError, match=r"worker.adapterCacheSize \(.+\) must be below worker.cacheSize"):
            chart.render({"worker": values}, name=RELEASE, namespace=NAMESPACE)


def test_pods_run_unprivileged(render):
    out = render()
    for doc in out.all("Deployment") + out.all("StatefulSet") + out.all("Job"):
        spec = doc["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def _readme_installs() -> list[tuple[str, str]]:
    """(section, the --set expressions joined) of every `helm install` in helm/README.md."""
    import re
    import shlex

    text = (CHART.parent / "README.md").read_text()
    installs = []
    for section, body in re.findall(r"^### (.+?)\n(.*?)(?=^##)", text, flags=re.S | re.M):
        for block in re.findall(r"```bash\n(.*?)```", body, flags=re.S):
            command = block.replace("\\\n", " ")
            for line in command.splitlines():
                if line.startswith("helm install"):
                    words = shlex.split(line)
                    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
                    installs.append((section, ",".join(sets)))
    return installs


def test_every_readme_example_renders(render):
    installs = _readme_installs()
    assert {s for s, _ in installs} >= {"CPU only (a laptop cluster, kind, minikube)", "External PostgreSQL",
                                         "One GPU per worker: 3 gateways x 4 workers", "S3 adapter store"}
    for section, sets in installs:
        out = render(helm.parse_set_string(sets))
        engines = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in out.all("StatefulSet") + out.all("Deployment")}
        assert engines & {"worker", "pool"}, section
