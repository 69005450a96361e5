"""scripts/kafka_local.sh: a restart keeps the broker's data; only ``start --fresh`` wipes it.

Runs its own broker on a free port pair (not the shared test broker), so it
needs Java and the broker jars but no running broker.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kafka_local.sh"
#: A broker that lives for one test: the JIT's first tier only (it starts in about half the CPU).
TEST_BROKER_JVM_FLAGS = "-XX:TieredStopAtLevel=1"


def free_port_pair() -> int:
    """A port whose successor is free too (client port, controller port).

    Below the kernel's ephemeral range: a port from there (``bind(0)``) can be
    taken by any outgoing connection of a concurrent test before the broker
    binds it, or while it is stopped and restarted on the same ports.
    """
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ uuid.uuid4().int)
    for _ in range(200):
        port = rng.randrange(10_000, max(10_002, low - 2))
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def script(port: int, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SPIKEGUARD_KAFKA_PORT": str(port),
        "SPIKEGUARD_KAFKA_CONTROLLER_PORT": str(port + 1),
        "SPIKEGUARD_PYTHON": os.environ.get("SPIKEGUARD_PYTHON", sys.executable),
        "SPIKEGUARD_KAFKA_JVM_FLAGS": TEST_BROKER_JVM_FLAGS,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=240
    )


def topics(port: int) -> set[str]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=10_000)
    try:
        return set(admin.list_topics())
    finally:
        admin.close()


def test_restart_keeps_topics_and_fresh_wipes_them():
    from spikeguard.bus.kafka import KafkaBus

    port = free_port_pair()
    name = f"keep-{uuid.uuid4().hex[:8]}"
    try:
        started = script(port, "start", "--fresh")
        assert started.returncode == 0, started.stderr
        bus = KafkaBus(f"127.0.0.1:{port}")
        bus.create_topics([name])
        producer = bus.producer()
        producer.publish(name, b"survives a restart", key="k")
        producer.close()
        assert script(port, "stop").returncode == 0

        again = script(port, "start")
        assert again.returncode == 0, again.stderr
        assert name in topics(port), "a plain restart lost the topics"
        assert [r.value for r in bus.read_all(name)] == [b"survives a restart"]
        assert script(port, "stop").returncode == 0

        fresh = script(port, "start", "--fresh")
        assert fresh.returncode == 0, fresh.stderr
        assert name not in topics(port), "start --fresh kept the old topics"
    finally:
        script(port, "stop")
        cache = Path(os.environ.get("SPIKEGUARD_CACHE", Path.home() / ".cache" / "spikeguard"))
        shutil.rmtree(cache / "kafka" / f"run-{port}", ignore_errors=True)


def test_unknown_start_option_is_refused():
    result = script(free_port_pair(), "start", "--frsh")
    assert result.returncode == 2 and "--frsh" in result.stderr
