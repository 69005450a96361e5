"""On a real broker: worker processes judge, `spikeguard monitor` serves lag and latency and
sends one webhook message, and a real Prometheus scraping both fires the critical alert."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from spikeguard.bus.kafka import KafkaBus
from spikeguard.schemas import StepEvent, Topics

pytestmark = pytest.mark.kafka
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "spikeguard-alerts.yml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def _wait(predicate, timeout: float, why: str, logs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(why + "\n" + "\n".join(Path(p).read_text()[-3000:] for p in logs))


class _Hook:
    def __init__(self):
        self.posts = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                owner.posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"


def test_workers_monitor_and_prometheus_on_kafka(kafka_bootstrap, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: apt-get install prometheus (scripts/test.sh does it)"
    prefix = f"mon-{uuid.uuid4().hex[:8]}."
    hook = _Hook()
    worker_port, monitor_port, prom_port = _free_port(), _free_port(), _free_port()
    # The test writes the steps itself, unsigned: the pipeline opts out of signing.
    env = {**os.environ, "SPIKEGUARD_BOOTSTRAP_SERVERS": kafka_bootstrap,
           "SPIKEGUARD_ALERTING__WEBHOOK_URL": hook.url, "SPIKEGUARD_INSECURE": "1"}
    logs = [tmp_path / "worker.log", tmp_path / "monitor.log", tmp_path / "prometheus.log"]
    common = ["--topic-prefix", prefix, "--set", "snapshot_interval_s=0.5"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "spikeguard", "worker", "all", "--metrics-port",
                          str(worker_port), *common], env=env, stdout=logs[0].open("w"),
                         stderr=subprocess.STDOUT),
        subprocess.Popen([sys.executable, "-m", "spikeguard", "monitor", "--metrics-port",
                          str(monitor_port), *common], env=env, stdout=logs[1].open("w"),
                         stderr=subprocess.STDOUT),
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n  - job_name: spikeguard\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{worker_port}', '127.0.0.1:{monitor_port}']}}]\n")
    procs.append(subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=logs[2].open("w"),
        stderr=subprocess.STDOUT))
    bus = KafkaBus(kafka_bootstrap)
    try:
        _wait(lambda: _text(worker_port) and _text(monitor_port), 90, "no /metrics", logs)
        topics = Topics(prefix)
        producer = bus.producer()
        now = time.time()
        for step in range(200):
            loss = float("nan") if step == 150 else 2.0 + 0.01 * (step % 7)
            event = StepEvent(run_id="kafka-run", step=step, loss=loss, grad_norm=1.0, time=now)
            producer.publish_events([(topics.steps, event)])
        producer.flush()

        def decisions_seen(count: int) -> bool:
            """Whether the monitor matched ``count`` decisions with their steps (it offers each
            decision to the notifier as it takes it in)."""
            text = _text(monitor_port) or ""
            return any(line.startswith("spikeguard_decision_latency_seconds_count")
                       and float(line.split()[-1]) >= count for line in text.splitlines())

        _wait(lambda: decisions_seen(150), 120, "the monitor saw no decisions", logs)

        def lag_lines() -> list[str]:
            return [line for line in (_text(monitor_port) or "").splitlines()
                    if line.startswith(f'spikeguard_consumer_lag_records{{group="{prefix}')]

        def groups() -> set[str]:
            return {line.split('group="')[1].split('"')[0] for line in lag_lines()}

        # A group's lag shows from its first commit: a worker saves (and commits) a partition
        # one snapshot interval after its first record there, not at once.
        wanted = {f"{prefix}statistical", f"{prefix}fusion", f"{prefix}monitor"}
        _wait(lambda: wanted <= groups(), 30, f"no lag of {wanted}", logs)
        assert all('partition="' in line for line in lag_lines())
        _wait(lambda: hook.posts, 30, "no webhook message", logs)
        assert 'run_id="kafka-run"' in _text(worker_port)  # the detectors' per-run series

        def critical():
            with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/alerts",
                                        timeout=5) as r:
                alerts = json.loads(r.read())["data"]["alerts"]
            return [a for a in alerts if a["state"] == "firing"
                    and a["labels"]["alertname"] == "SpikeguardCriticalDecision"]

        (alert,) = _wait(critical, 60, "SpikeguardCriticalDecision did not fire", logs)
        assert alert["labels"]["run_id"] == "kafka-run"
        # Later decisions of the same incident must not page again: once the monitor has taken
        # in the decision of every step, any second alert would be on its way.
        _wait(lambda: decisions_seen(200), 60, "the monitor did not see every step's decision", logs)
        assert len(hook.posts) == 1
        assert hook.posts[0]["spikeguard"]["run_id"] == "kafka-run"
        assert hook.posts[0]["spikeguard"]["urgency"] == "critical"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        hook.server.shutdown()
        bus.close()
