"""The deploy/ files: the systemd unit (systemd-analyze verify where it exists),
the Kubernetes manifests (parsed, required fields, the ConfigMap's TOML passes
kvd's own validation), the Dockerfile (parsed; no Docker engine here) and the
Grafana dashboard's JSON."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.config.loading import load_config
from kvd.config.pool_members import parse_spec
from kvd.config.sizes import parse_size
from tests.support import REPO

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "kvd.service"
K8S = DEPLOY / "k8s"
VERIFY_TIMEOUT_S = 60


# ---- systemd ------------------------------------------------------------------------
def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_restarts_and_is_hardened() -> None:
    s = unit_settings()
    assert s["Type"] in (["notify"], ["simple"])
    assert s["Restart"] == ["on-failure"]
    assert s["NoNewPrivileges"] == ["yes"]
    assert s["ProtectSystem"] == ["strict"]
    assert s["LimitMEMLOCK"] == ["infinity"]
    assert "/var/lib/kvd" in s["ReadWritePaths"][0].split()
    assert s["ExecStart"][0].split()[1] == "serve"
    assert s["KillSignal"] == ["SIGTERM"]
    assert s["ExecReload"][0].endswith("-HUP $MAINPID")
    assert s["User"] != ["root"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart exists; kvd need not be installed here.
    unit = tmp_path / "kvd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/kvd", shutil.which("true") or ""))
    result = subprocess.run(
        [analyze, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=VERIFY_TIMEOUT_S,
        check=False,
    )
    if "Failed to" in result.stderr and "bus" in result.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "kvd.service" not in result.stderr, result.stderr


# ---- Kubernetes ---------------------------------------------------------------------
def manifests() -> dict[str, dict[str, Any]]:
    """Every object of deploy/k8s by ``Kind/name``."""
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["apiVersion"] and doc["metadata"]["name"], path
                name = f"{doc['kind']}/{doc['metadata']['name']}"
                assert name not in docs, f"{name} defined twice"
                docs[name] = doc
    return docs


def config_toml() -> str:
    return str(manifests()["ConfigMap/kvd-config"]["data"]["kvd.toml"])


def test_configmap_passes_kvd_validation(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(config_toml())
    config = load_config(str(path), pod_environment(), {})
    assert config.auth_tokens_file  # non-loopback listeners need it
    assert config.socket.startswith("/run/kvd/")
    assert config.shm_dir == "/dev/shm/kvd"


def test_configmap_tls_block_passes_kvd_validation(tmp_path: Path) -> None:
    """The commented TLS lines, turned on, make a valid pool with TLS on its
    bulk ports: members read each other's values there, over TLS."""
    lines = config_toml().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("# tls_cert_file"))
    end = next(i for i in range(start, len(lines)) if "pool_tls_server_name" in lines[i])
    lines[start : end + 1] = [line.replace("# ", "", 1) for line in lines[start : end + 1]]
    path = tmp_path / "kvd.toml"
    path.write_text("\n".join(lines) + "\n")
    config = load_config(str(path), pod_environment(), {})
    assert config.bulk_tls and config.pool_tls_ca_file and config.tls_client_ca_file
    assert config.pool_peer_transport == "auto"  # the bulk port, with TLS


def test_secret_holds_a_valid_token_table(tmp_path: Path) -> None:
    from kvd.paths.auth import TokenTable

    secret = manifests()["Secret/kvd-tokens"]
    path = tmp_path / "tokens.toml"
    path.write_text(secret["stringData"]["tokens.toml"])
    assert TokenTable.load(str(path)).entries


def volume_paths(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> hostPath path, for the hostPath volumes the container mounts."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}


def test_daemonset() -> None:
    ds = manifests()["DaemonSet/kvd"]
    assert ds["apiVersion"] == "apps/v1"
    template = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    pod = template["spec"]
    (container,) = pod["containers"]
    config = tomllib.loads(config_toml())
    # hostPath for the socket dir, the shm dir and every SSD path.
    mounts = volume_paths(pod, container)
    needed = [str(Path(config["socket"]).parent), config["shm_dir"]]
    needed += [str(Path(p).parent) for p in config["ssd_path"]]
    assert all(path in mounts for path in needed), (needed, mounts)
    # Memory: requests == limits, covering the pool and the process.
    resources = container["resources"]
    limit = parse_size(resources["limits"]["memory"].replace("Gi", "GiB"))
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert limit > parse_size(config["dram_bytes"])
    # Liveness and readiness through grpc.health.v1 on the gRPC port.
    port = int(config["listen"].rpartition(":")[2])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == port
    assert ports["metrics"] == int(config["metrics_listen"].rpartition(":")[2])
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    # The hand-off to the other pods and the drain fit in the termination grace period.
    stopping_ms = config["pool_leave_handoff_ms"] + config["shutdown_grace_ms"]
    assert pod["terminationGracePeriodSeconds"] * 1000 > stopping_ms
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_headless_service_selects_the_daemonset() -> None:
    docs = manifests()
    service = docs["Service/kvd"]
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = docs["DaemonSet/kvd"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {p["targetPort"] for p in service["spec"]["ports"]}
    (container,) = docs["DaemonSet/kvd"]["spec"]["template"]["spec"]["containers"]
    assert names <= {p["name"] for p in container["ports"]}


def pod_environment(pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """The kvd container's environment as Kubernetes expands it for a pod at ``pod_ip``."""
    (container,) = manifests()["DaemonSet/kvd"]["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", item
            env[item["name"]] = pod_ip
        else:  # $(NAME) expands variables defined above it
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], item["value"])
    return env


def test_the_pool_settings_agree_with_the_manifests(tmp_path: Path) -> None:
    docs = manifests()
    path = tmp_path / "kvd.toml"
    path.write_text(config_toml())
    config = load_config(str(path), pod_environment("10.1.2.3"), {})
    # pool_members names the pool's headless Service, in the DaemonSet's
    # namespace, on the gRPC port the daemons listen on.
    spec = parse_spec(config.pool_members)
    assert spec is not None and spec.kind == "dns"
    ((name, port),) = spec.endpoints
    service_name, namespace, *cluster = name.split(".")
    assert cluster == ["svc", "cluster", "local"]
    ds = docs["DaemonSet/kvd"]
    assert namespace == ds["metadata"]["namespace"]
    service = docs[f"Service/{service_name}"]
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses") is True  # a starting pod sees itself
    pod = ds["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (service_port,) = (p for p in service["spec"]["ports"] if p["port"] == port)
    assert ports[service_port["targetPort"]] == port == int(config.listen.rpartition(":")[2])
    # pool_advertise: this pod's IP on that port (the downward API).
    assert config.pool_advertise == f"10.1.2.3:{port}"
    # The pool token: a mounted Secret, admitted to every namespace by the token table.
    token_dir, _, token_key = config.pool_token_file.rpartition("/")
    (mount,) = (m for m in container["volumeMounts"] if m["mountPath"] == token_dir)
    (volume,) = (v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    token_secret = docs[f"Secret/{volume['secret']['secretName']}"]
    assert token_secret["stringData"][token_key].strip()
    tokens = tomllib.loads(docs["Secret/kvd-tokens"]["stringData"]["tokens.toml"])
    (pool_token,) = (t for t in tokens["tokens"] if t["name"] == "pool")
    assert pool_token["namespaces"] == ["*"] and re.fullmatch(r"[0-9a-f]{64}", pool_token["sha256"])
    # KV events: the container exposes the ports the endpoints bind, and the
    # topic names the pod as llm-d's indexer reads it (kv@<pod>@<model>).
    for endpoint in (config.kv_events_endpoint, config.kv_events_replay_endpoint):
        assert int(endpoint.rpartition(":")[2]) in ports.values()
    assert config.kv_events_topic == "kv@10.1.2.3@kvd"
    # Membership from DNS needs no API access: no ServiceAccount token, no RBAC.
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert not any(d["kind"] in ("Role", "ClusterRole") for d in docs.values())


# ---- Dockerfile -------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    instructions = []
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def test_dockerfile() -> None:
    steps = dockerfile()
    froms = [args for word, args in steps if word == "FROM"]
    assert froms and all(f.startswith("python:3.11-slim") for f in froms)
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert "liburing-dev" in runs and "import kvd.io._uring" in runs
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = json.loads(next(args for word, args in final if word == "ENTRYPOINT"))
    cmd = json.loads(next(args for word, args in final if word == "CMD"))
    assert entry + cmd == ["kvd", "serve"]
    health = next(args for word, args in final if word == "HEALTHCHECK")
    assert "kvd" in shlex.split(health.split("CMD", 1)[1].replace('"', " ").replace(",", " "))
    exposed = " ".join(args for word, args in final if word == "EXPOSE").split()
    assert {"7070", "7071", "9470"} <= set(exposed)
    copied = [args.split()[0] for word, args in steps if word == "COPY" and "--from" not in args]
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv" in ignored
    assert not set(copied) & set(ignored), "the image copies something .dockerignore drops"


def test_the_healthcheck_command_exists() -> None:
    from kvd.cli import build_parser

    args = build_parser().parse_args(["health", "--target", "127.0.0.1:7070"])
    assert args.command == "health"


# ---- Grafana ------------------------------------------------------------------------------
def test_dashboard_is_grafana_json() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kvd-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        # Grafana keeps one query per refId: a second one of a panel is lost.
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
