"""The deploy/ files: the systemd unit (systemd-analyze verify where it exists),
the Kubernetes manifests (parsed, required fields, the ConfigMap's TOML passes
kvd's own validation), the Dockerfile (parsed; no Docker engine here) and the
Grafana dashboard's JSON."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.config.settings import load_config
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
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["apiVersion"] and doc["metadata"]["name"], path
                docs[doc["kind"]] = doc
    return docs


def config_toml() -> str:
    return str(manifests()["ConfigMap"]["data"]["kvd.toml"])


def test_configmap_passes_kvd_validation(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(config_toml())
    config = load_config(str(path), {}, {})
    assert config.auth_tokens_file  # non-loopback listeners need it
    assert config.socket.startswith("/run/kvd/")
    assert config.shm_dir == "/dev/shm/kvd"


def test_secret_holds_a_valid_token_table(tmp_path: Path) -> None:
    from kvd.paths.auth import TokenTable

    secret = manifests()["Secret"]
    path = tmp_path / "tokens.toml"
    path.write_text(secret["stringData"]["tokens.toml"])
    assert TokenTable.load(str(path)).entries


def volume_paths(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> hostPath path, for the hostPath volumes the container mounts."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}


def test_daemonset() -> None:
    ds = manifests()["DaemonSet"]
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
    # Drain fits in the termination grace period.
    assert pod["terminationGracePeriodSeconds"] * 1000 > config["shutdown_grace_ms"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_headless_service_selects_the_daemonset() -> None:
    docs = manifests()
    service = docs["Service"]
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = docs["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {p["targetPort"] for p in service["spec"]["ports"]}
    (container,) = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert names <= {p["name"] for p in container["ports"]}


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
