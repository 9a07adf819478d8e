"""The real Prometheus, promtool and Alertmanager for the monitoring tests, from Debian's `prometheus` and
`prometheus-alertmanager` packages (`bash scripts/prometheus.sh ensure`, called by `make test`, installs them).

Servers are started by the tests themselves on 127.0.0.1, on free ports, with their storage in a temp dir, and
stopped (by their pid) at the end of the session. Without the binaries the tests are skipped loudly, or fail
with CHIPLEDGER_REQUIRE_PROMETHEUS=1 (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

REQUIRE_ENV = "CHIPLEDGER_REQUIRE_PROMETHEUS"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def unavailable(msg: str):
    msg = f"{msg}; run `bash scripts/prometheus.sh ensure` (installs Debian's prometheus and prometheus-alertmanager)"
    if required():
        pytest.fail(f"{msg} ({REQUIRE_ENV}=1)", pytrace=False)
    print(f"\n#### SKIPPED (monitoring): {msg}\n")
    pytest.skip(msg)


def tool(*names: str) -> str:
    """The path of the first of `names` on PATH, or skip / fail."""
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    unavailable(f"{' or '.join(names)} not found on PATH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, data: Optional[bytes] = None, method: Optional[str] = None, timeout: float = 10.0):
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Prometheus:
    """A Prometheus server whose scrape targets and rule files the tests set (`configure`, then a reload)."""

    def __init__(self, root: Path, data: Optional[Path] = None, retention: str = "1d"):
        """`data`: the TSDB folder (default root/data); `retention`: long for blocks backfilled from the past."""
        self.binary = tool("prometheus")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = root / "prometheus.yml"
        self.log = root / "prometheus.log"
        self.configure([], [])
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={data or root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle",
             f"--storage.tsdb.retention.time={retention}", "--log.level=warn"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_ready(f"{self.url}/-/ready", self.proc, self.log)

    def configure(self, targets: list[str], rule_files: list[Path], interval: str = "1s") -> None:
        cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
               "rule_files": [str(p) for p in rule_files],
               "scrape_configs": [{"job_name": "chipledger", "static_configs": [{"targets": targets}]}]}
        self.config.write_text(json.dumps(cfg))  # JSON is YAML
        if hasattr(self, "proc"):
            urllib.request.urlopen(urllib.request.Request(f"{self.url}/-/reload", method="POST"), timeout=10).read()

    def api(self, path: str, **params):
        q = urllib.parse.urlencode(params)
        return http_json(f"{self.url}/api/v1/{path}" + (f"?{q}" if q else ""))

    def query(self, expr: str, at: Optional[float] = None) -> list:
        out = self.api("query", query=expr, **({} if at is None else {"time": at}))
        assert out["status"] == "success", out
        return out["data"]["result"]

    def stop(self) -> None:
        stop(self.proc)


class Alertmanager:
    def __init__(self, root: Path):
        self.binary = tool("prometheus-alertmanager", "alertmanager")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = root / "alertmanager.yml"
        cfg.write_text(json.dumps({"route": {"receiver": "null", "group_wait": "1s"},
                                   "receivers": [{"name": "null"}]}))
        self.log = root / "alertmanager.log"
        (root / "am-data").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={cfg}", f"--storage.path={root / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_ready(f"{self.url}/-/ready", self.proc, self.log)

    def alerts(self) -> list[dict]:
        return http_json(f"{self.url}/api/v2/alerts")

    def stop(self) -> None:
        stop(self.proc)


def promtool(*args: str, cwd: Optional[Path] = None, stdin: Optional[bytes] = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, input=stdin, capture_output=True, timeout=300)
