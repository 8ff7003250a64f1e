"""deploy/: Dockerfile, compose stack, Prometheus/Grafana provisioning, dashboard, k8s.

Static checks only (no network, no engine, no container is started): every YAML file
parses, the pieces point at each other consistently (service names, ports, bind-mounted
paths, labels and selectors, volume claims) and the dashboard only uses metric names
that exist. `docker compose config` runs when a compose CLI is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.deploy_metrics import dashboard_metric_names, iter_panels, metric_names_in_expr

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "capsteer.json"
K8S = DEPLOY / "k8s" / "capsteer.yaml"
NFS_PV = DEPLOY / "k8s" / "nfs-pv.yaml"
OPS_DOC = ROOT / "docs" / "operations-deploy.md"

# api.md §6 (and capsteer_graph_replays_total and capsteer_capture_engine_wait_seconds_total,
# which extend it) plus the vLLM
# metrics checked on a live server: the only names the dashboard may use, and all of
# them must be on it.
CAPSTEER_METRICS = {
    "capsteer_capture_requests_total",
    "capsteer_capture_bytes_total",
    "capsteer_capture_files_total",
    "capsteer_capture_publish_seconds",
    "capsteer_capture_inflight_bytes",
    "capsteer_capture_dropped_total",
    "capsteer_capture_rejected_total",
    "capsteer_fsync_seconds",
    "capsteer_steering_requests_total",
    "capsteer_steering_refused_total",
    "capsteer_steering_vectors",
    "capsteer_readout_rows_total",
    "capsteer_readers",
    "capsteer_graph_replays_total",
    "capsteer_capture_engine_wait_seconds_total",
}
VLLM_METRICS = {
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
}
ALLOWED_METRICS = CAPSTEER_METRICS | VLLM_METRICS


# ---------------------------------------------------------------- helpers

def load_yaml_docs(path: Path) -> list:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def compose() -> dict:
    (doc,) = load_yaml_docs(COMPOSE)
    return doc


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: str(v) for k, v in env.items()}


def bind_mounts(service: dict) -> list[tuple[Path, PurePosixPath]]:
    """(host path resolved against the compose file's folder, container path) of every
    bind mount (a source starting with . or /); named volumes are left out."""
    mounts = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            if vol.get("type") != "bind":
                continue
            source, target = vol["source"], vol["target"]
        else:
            source, target = vol.split(":")[:2]
            if not source.startswith((".", "/")):
                continue
        mounts.append(((COMPOSE.parent / source).resolve(), PurePosixPath(target)))
    return mounts


def named_volumes(service: dict) -> dict[str, str]:
    """container path -> volume name for the named volumes of a service."""
    out = {}
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            if vol.get("type") == "volume":
                out[vol["target"]] = vol["source"]
            continue
        source, target = vol.split(":")[:2]
        if not source.startswith((".", "/")):
            out[target] = source
    return out


def host_path(service: dict, container_path: str) -> Path | None:
    """Where a container path of `service` lives on the host, through its bind mounts."""
    path = PurePosixPath(container_path)
    for host, target in bind_mounts(service):
        if path == target or target in path.parents:
            return host / path.relative_to(target)
    return None


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return str(argv[i + 1])
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def container_ports(service: dict) -> set[int]:
    ports = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            ports.add(int(port["target"]))
        else:
            ports.add(int(str(port).split(":")[-1].split("/")[0]))
    return ports


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def dockerfile_values(name: str) -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == name]


def k8s_docs() -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for doc in load_yaml_docs(K8S):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def subset(small: dict, big: dict) -> bool:
    return all(big.get(k) == v for k, v in small.items())


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def data_panels() -> list[dict]:
    return [p for p in iter_panels(dashboard()["panels"]) if p.get("type") != "row"]


# ---------------------------------------------------------------- YAML

def test_every_yaml_file_under_deploy_parses():
    files = yaml_files()
    names = {p.relative_to(DEPLOY).as_posix() for p in files}
    assert {"compose.yaml", "prometheus/prometheus.yml",
            "grafana/provisioning/datasources/prometheus.yaml",
            "grafana/provisioning/dashboards/capsteer.yaml",
            "k8s/capsteer.yaml", "k8s/nfs-pv.yaml"} <= names
    for path in files:
        docs = load_yaml_docs(path)
        assert docs, f"{path} holds no YAML document"
        assert all(isinstance(doc, dict) for doc in docs), path


# ---------------------------------------------------------------- compose

def test_compose_services():
    services = compose()["services"]
    assert set(services) == {"capsteer", "prometheus", "grafana"}


def test_compose_capsteer_service():
    svc = compose()["services"]["capsteer"]
    build = svc["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE

    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]

    argv = [str(a) for a in svc["command"]]
    assert argv[0] and not argv[0].startswith("-"), "first argument must be the model"
    assert flag_value(argv, "--host") == "0.0.0.0"
    port = int(flag_value(argv, "--port") or 8000)
    assert port == 8000 and port in container_ports(svc)
    assert flag_value(argv, "--capture-overload") in ("block", "drop", "reject")

    volumes = named_volumes(svc)
    declared = set(compose().get("volumes") or {})
    for flag in ("--capture-dir", "--steering-dir"):
        path = flag_value(argv, flag)
        assert path in volumes, f"{flag} {path} is not on a volume"
    hf_home = next(v for k, v in env_of_dockerfile().items() if k == "HF_HOME")
    assert hf_home in volumes, "the HF cache (HF_HOME of the image) is not on a volume"
    assert set(volumes.values()) <= declared


def env_of_dockerfile() -> dict[str, str]:
    env = {}
    for rest in dockerfile_values("ENV"):
        for token in shlex.split(rest):
            if "=" in token:
                key, value = token.split("=", 1)
                env[key] = value
    return env


def test_command_and_env_values_are_strings():
    """Compose and Kubernetes both want strings here; YAML turns 8000 or true into others."""
    for name, svc in compose()["services"].items():
        for arg in svc.get("command") or []:
            assert isinstance(arg, str), f"compose {name}: command item {arg!r}"
        for key, value in (svc.get("environment") or {}).items():
            assert isinstance(value, str), f"compose {name}: {key}={value!r}"
    (deployment,) = k8s_docs()["Deployment"]
    for container in deployment["spec"]["template"]["spec"]["containers"]:
        for arg in container.get("args") or []:
            assert isinstance(arg, str), f"k8s args item {arg!r}"
        for env in container.get("env") or []:
            assert "valueFrom" in env or isinstance(env.get("value"), str), env


def test_prometheus_scrapes_the_capsteer_service():
    services = compose()["services"]
    prom = services["prometheus"]
    config_path = flag_value(prom.get("command") or [], "--config.file") \
        or "/etc/prometheus/prometheus.yml"
    host_config = host_path(prom, config_path)
    assert host_config == DEPLOY / "prometheus" / "prometheus.yml"
    (config,) = load_yaml_docs(host_config)

    jobs = [j for j in config["scrape_configs"]
            for sc in j.get("static_configs", []) for t in sc["targets"]
            if t.split(":")[0] == "capsteer"]
    assert len(jobs) == 1
    (job,) = jobs
    (target,) = [t for sc in job["static_configs"] for t in sc["targets"]]
    host, port = target.split(":")
    assert host in services
    capsteer_port = int(flag_value([str(a) for a in services["capsteer"]["command"]],
                                   "--port") or 8000)
    assert int(port) == capsteer_port
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["scrape_interval"] == "5s"


def test_grafana_provisioning_paths_exist_through_the_bind_mounts():
    services = compose()["services"]
    graf = services["grafana"]
    provisioning = host_path(graf, "/etc/grafana/provisioning")
    assert provisioning is not None and provisioning.is_dir()

    (datasources,) = load_yaml_docs(host_path(graf,
                                              "/etc/grafana/provisioning/datasources/prometheus.yaml"))
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus"
    url = re.fullmatch(r"http://([^:/]+):(\d+)/?", ds["url"])
    assert url and url.group(1) == "prometheus" and url.group(1) in services
    assert url.group(2) in {p.split(":")[-1] for p in services["prometheus"]["ports"]}

    (providers,) = load_yaml_docs(host_path(graf,
                                            "/etc/grafana/provisioning/dashboards/capsteer.yaml"))
    (provider,) = providers["providers"]
    dash_dir = host_path(graf, provider["options"]["path"])
    assert dash_dir == DASHBOARD.parent
    assert (dash_dir / "capsteer.json").is_file()

    # The dashboard's data source variable defaults to the provisioned data source.
    (var,) = [v for v in dashboard()["templating"]["list"] if v["type"] == "datasource"]
    assert var["current"]["value"] == ds["uid"]

    env = env_of(graf)
    home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert host_path(graf, home) == DASHBOARD
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${"), "admin password must come from env"


def compose_cli() -> list[str] | None:
    candidates = []
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for cli in candidates:
        try:
            done = subprocess.run([*cli, "version"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return cli
    return None


def test_docker_compose_config():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI on this machine (`docker compose version` fails)")
    env = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only"}
    done = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                          text=True, timeout=60, env=env)
    if done.returncode != 0 and re.search(r"daemon|docker\.sock", done.stderr, re.I):
        pytest.skip(f"docker daemon not reachable: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- Dockerfile

def test_dockerfile_base_entrypoint_and_healthcheck():
    args = {}
    for rest in dockerfile_values("ARG"):
        key, _, value = rest.partition("=")
        args[key] = value
    (base,) = dockerfile_values("FROM")
    base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], base)
    assert base.split()[0] == "vllm/vllm-openai:v0.26.0"

    (entrypoint,) = dockerfile_values("ENTRYPOINT")
    assert json.loads(entrypoint) == ["capsteer", "serve"]
    (cmd,) = dockerfile_values("CMD")
    cmd = json.loads(cmd)
    assert cmd[0] and not cmd[0].startswith("-")
    assert flag_value(cmd, "--host") == "0.0.0.0"
    assert flag_value(cmd, "--port") == "8000"
    assert flag_value(cmd, "--capture-dir") == "/captures"
    assert flag_value(cmd, "--steering-dir") == "/steering-vectors"

    (health,) = dockerfile_values("HEALTHCHECK")
    assert "CMD" in health and "/health" in health and ":8000" in health
    assert "8000" in " ".join(dockerfile_values("EXPOSE")).split()
    (volume,) = dockerfile_values("VOLUME")
    volume = json.loads(volume) if volume.startswith("[") else volume.split()
    assert {"/captures", "/steering-vectors"} <= set(volume)


def test_dockerfile_runs_as_a_non_root_user():
    users = dockerfile_values("USER")
    assert users, "no USER instruction"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # k8s runAsNonRoot needs a numeric uid to check; the Deployment uses the same one.
    assert user.isdigit()
    (deployment,) = k8s_docs()["Deployment"]
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)


def test_dockerfile_installs_the_repo_and_copies_every_package_folder():
    tomllib = pytest.importorskip("tomllib")
    run = " ".join(dockerfile_values("RUN"))
    assert '".[gpu]"' in run or "'.[gpu]'" in run or " .[gpu]" in run
    copied = set()
    for rest in dockerfile_values("COPY"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is not in the repo"
            copied.add(source.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders | {"pyproject.toml"} <= copied


def test_dockerfile_names_no_package_index():
    text = DOCKERFILE.read_text()
    assert "index-url" not in text.lower()
    for host in re.findall(r"https?://([^/:'\"\s]+)", text):
        assert host in ("127.0.0.1", "localhost"), f"Dockerfile names a remote host: {host}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


# ---------------------------------------------------------------- k8s

def test_k8s_kinds_labels_selectors_and_ports():
    docs = k8s_docs()
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor"}
    (deployment,) = docs["Deployment"]
    (service,) = docs["Service"]
    (monitor,) = docs["ServiceMonitor"]

    spec = deployment["spec"]
    assert spec["replicas"] == 1
    pod_labels = spec["template"]["metadata"]["labels"]
    assert subset(spec["selector"]["matchLabels"], pod_labels)
    assert subset(service["spec"]["selector"], pod_labels)

    (container,) = spec["template"]["spec"]["containers"]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    named_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named_ports.get("http") == 8000
    assert int(flag_value([str(a) for a in container["args"]], "--port")) == 8000
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health"
        assert get["port"] in named_ports or get["port"] in named_ports.values()

    (svc_port,) = service["spec"]["ports"]
    assert svc_port["name"] == "http" and svc_port["port"] == 8000
    assert svc_port["targetPort"] in named_ports or svc_port["targetPort"] == 8000

    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert subset(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"


def test_k8s_volumes_claims_and_shm():
    docs = k8s_docs()
    (deployment,) = docs["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    claims = {c["metadata"]["name"]: c for c in docs["PersistentVolumeClaim"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert set(mounts.values()) <= set(volumes)

    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] in claims

    argv = [str(a) for a in container["args"]]
    captures = volumes[mounts[flag_value(argv, "--capture-dir")]]
    assert captures["persistentVolumeClaim"]["claimName"] == "capsteer-captures"
    vectors = volumes[mounts[flag_value(argv, "--steering-dir")]]
    assert "persistentVolumeClaim" in vectors or "configMap" in vectors

    claim = claims["capsteer-captures"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"]

    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory"


def test_nfs_pv_example_fits_the_captures_claim():
    (pv,) = load_yaml_docs(NFS_PV)
    assert pv["kind"] == "PersistentVolume"
    spec = pv["spec"]
    assert {"server", "path"} <= set(spec["nfs"])
    options = spec["mountOptions"]
    assert "hard" in options and "noatime" in options and "soft" not in options
    (vers,) = [o.split("=", 1)[1] for o in options if o.startswith(("nfsvers=", "vers="))]
    assert tuple(int(x) for x in vers.split(".")) >= (4, 1)

    claims = {c["metadata"]["name"]: c for c in k8s_docs()["PersistentVolumeClaim"]}
    claim = claims[spec["claimRef"]["name"]]
    assert spec["storageClassName"] == claim["spec"]["storageClassName"]
    assert set(claim["spec"]["accessModes"]) <= set(spec["accessModes"])


# ---------------------------------------------------------------- dashboard

def test_dashboard_loads_and_every_panel_queries_prometheus():
    dash = dashboard()
    assert dash["uid"] and dash["title"]
    assert 36 <= dash["schemaVersion"] <= 41
    panels = list(iter_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ref = f"${{{var['name']}}}"

    panels = data_panels()
    assert len(panels) >= 10
    for panel in panels:
        targets = panel.get("targets") or []
        assert targets, f"panel {panel['title']!r} has no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids))
        for target in targets:
            assert target.get("expr", "").strip(), f"panel {panel['title']!r}: empty expr"
            assert target.get("datasource", panel["datasource"])["uid"] == ref
        assert panel["datasource"] == {"type": "prometheus", "uid": ref}
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24


def test_dashboard_uses_exactly_the_known_metrics():
    names = dashboard_metric_names(DASHBOARD)
    assert names - ALLOWED_METRICS == set(), "unknown metric names on the dashboard"
    assert ALLOWED_METRICS - names == set(), "metrics missing from the dashboard"


def test_dashboard_capsteer_metrics_are_registered_by_the_code():
    from capsteer.capture import metrics as capture_metrics
    from capsteer.server import metrics as server_metrics

    registered = set()
    for registry in (capture_metrics.REGISTRY, server_metrics.REGISTRY):
        for family in registry.collect():
            registered.add(family.name + "_total" if family.type == "counter" else family.name)
    used = {n for n in dashboard_metric_names(DASHBOARD) if n.startswith("capsteer_")}
    assert used <= registered


def test_histogram_quantiles_aggregate_by_le():
    for panel in data_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            if "histogram_quantile" in expr:
                assert "_bucket[" in expr and re.search(r"by \(([^)]*\b)?le\b", expr), expr


def test_ops_doc_explains_every_panel():
    text = OPS_DOC.read_text()
    for panel in data_panels():
        assert panel["title"] in text, f"docs/operations-deploy.md misses panel {panel['title']!r}"
    for needle in ("docker compose -f deploy/compose.yaml up", "kubectl apply",
                   "capsteer_fsync_seconds", "hard", "soft", "noac", "--capture-budget"):
        assert needle in text, needle


# ---------------------------------------------------------------- deploy_metrics helper

def test_metric_names_in_expr():
    assert metric_names_in_expr(
        "histogram_quantile(0.99, sum by (le) (rate(capsteer_fsync_seconds_bucket[1m])))"
    ) == {"capsteer_fsync_seconds"}
    assert metric_names_in_expr("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))") == {
        "vllm:prompt_tokens_total"}
    # _total is not a histogram suffix; _count and _sum are.
    assert metric_names_in_expr(
        "rate(capsteer_capture_publish_seconds_sum[5m]) / "
        "rate(capsteer_capture_publish_seconds_count[5m]) + capsteer_capture_bytes_total"
    ) == {"capsteer_capture_publish_seconds", "capsteer_capture_bytes_total"}
    # Label values, label names, functions and other metrics are not picked up.
    assert metric_names_in_expr(
        'sum by (status) (rate(capsteer_capture_requests_total{status="capsteer_x", '
        "job='vllm:y'}[1m])) or up or process_cpu_seconds_total"
    ) == {"capsteer_capture_requests_total"}
    assert metric_names_in_expr('label_replace(vllm:num_requests_running, "a", "$1", '
                                '"model_name", "(.*)")') == {"vllm:num_requests_running"}
    assert metric_names_in_expr("max_over_time(vllm:num_requests_waiting[5m:30s])") == {
        "vllm:num_requests_waiting"}
    assert metric_names_in_expr("") == set()


def test_dashboard_metric_names_walks_nested_rows(tmp_path):
    dash = {"panels": [
        {"type": "row", "collapsed": True, "panels": [
            {"type": "timeseries", "targets": [
                {"expr": "sum(rate(capsteer_capture_files_total[1m]))"},
                {"expr": ""},
                {"refId": "B"}]}]},
        {"type": "stat", "targets": [{"expr": "max(capsteer_steering_vectors)"}]},
        {"type": "text"},
        {"type": "timeseries", "targets": [
            {"expr": "histogram_quantile(0.5, sum by (le) "
                     "(rate(vllm:time_to_first_token_seconds_bucket[1m])))"}]},
    ]}
    path = tmp_path / "dash.json"
    path.write_text(json.dumps(dash))
    assert dashboard_metric_names(path) == {
        "capsteer_capture_files_total", "capsteer_steering_vectors",
        "vllm:time_to_first_token_seconds"}
    assert dashboard_metric_names(str(path)) == dashboard_metric_names(path)
