"""A real Prometheus (Debian's prometheus) on a loopback port, scraping the
targets it is given every second, and its query API."""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from kvd.tools.bench.services import spawn_logged, wait_ready
from tests.cluster.cluster import free_ports

START_TIMEOUT_S = 30.0
SCRAPE_INTERVAL = "1s"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """One Prometheus scraping ``targets`` (HOST:PORT of /metrics) as job kvd."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        binary = prometheus_binary()
        assert binary is not None
        self.workdir = workdir
        (self.port,) = free_ports(1)
        config = workdir / "prometheus.yml"
        every = {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL}
        jobs = [{"job_name": "kvd", "static_configs": [{"targets": targets}]}]
        config.write_text(json.dumps({"global": every, "scrape_configs": jobs}))  # JSON is YAML
        log = workdir / "prometheus.log"
        self.proc = spawn_logged(
            [
                binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            log,
        )  # fmt: skip
        wait_ready(self.proc, self._ready, log, "prometheus", START_TIMEOUT_S, poll_s=0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url("/-/ready"), timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (an error raises)."""
        url = self.url("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
