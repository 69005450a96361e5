"""The closed loop over SASL_SSL (SCRAM-SHA-512 on TLS), and a password that never shows.

Starts its own broker (``scripts/kafka_local.sh start --fresh --sasl-ssl``) on
free ports, with certificates made by openssl in a temporary directory, and a
SCRAM user created through the admin API. The pipeline (``spikeguard worker
all``, DEBUG logging) and the trainer's guard talk to it over SASL_SSL only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

from .test_kafka_local import TEST_BROKER_JVM_FLAGS

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
USER = "spikeguard-trainer"


def _load_e2e():
    spec = importlib.util.spec_from_file_location(
        "e2e_loop", Path(__file__).with_name("test_end_to_end.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 all free (client, controller, SASL_SSL)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory):
    from kafka import KafkaAdminClient
    from kafka.admin import UserScramCredentialUpsertion

    port = free_ports(3)
    tls = tmp_path_factory.mktemp("tls")
    env = {
        **os.environ,
        "SPIKEGUARD_KAFKA_PORT": str(port),
        "SPIKEGUARD_KAFKA_CONTROLLER_PORT": str(port + 1),
        "SPIKEGUARD_KAFKA_SASL_PORT": str(port + 2),
        "SPIKEGUARD_KAFKA_TLS_DIR": str(tls),
        "SPIKEGUARD_PYTHON": os.environ.get("SPIKEGUARD_PYTHON", sys.executable),
        "SPIKEGUARD_KAFKA_JVM_FLAGS": TEST_BROKER_JVM_FLAGS,
    }
    script = ["bash", str(ROOT / "scripts" / "kafka_local.sh")]
    password = "pw-" + secrets.token_hex(12)
    try:
        started = subprocess.run(
            [*script, "start", "--fresh", "--sasl-ssl"],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert started.returncode == 0, started.stderr
        admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")  # PLAINTEXT, loopback
        try:
            assert admin.alter_user_scram_credentials(
                [UserScramCredentialUpsertion(USER, "SCRAM-SHA-512", password)]
            ) == {USER: None}
        finally:
            admin.close()
        yield {
            "bootstrap": f"127.0.0.1:{port + 2}",
            "cafile": str(tls / "ca.pem"),
            "password": password,
        }
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True, timeout=120)
        cache = Path(os.environ.get("SPIKEGUARD_CACHE", Path.home() / ".cache" / "spikeguard"))
        shutil.rmtree(cache / "kafka" / f"run-{port}", ignore_errors=True)


def sasl_env(broker, prefix: str, password: str, key: str) -> dict[str, str]:
    return {
        "SPIKEGUARD_BOOTSTRAP_SERVERS": broker["bootstrap"],
        "SPIKEGUARD_SECURITY_PROTOCOL": "SASL_SSL",
        "SPIKEGUARD_SASL_MECHANISM": "SCRAM-SHA-512",
        "SPIKEGUARD_SASL_USERNAME": USER,
        "SPIKEGUARD_SASL_PASSWORD": password,
        "SPIKEGUARD_SSL_CAFILE": broker["cafile"],
        "SPIKEGUARD_TOPIC_PREFIX": prefix,
        "SPIKEGUARD_SIGNING_KEY": key,
    }


def test_the_closed_loop_runs_over_sasl_ssl_and_the_password_never_shows(
    sasl_broker, tmp_path, monkeypatch, caplog, wait_until
):
    e2e = _load_e2e()
    prefix = f"sasl-{uuid.uuid4().hex[:8]}."
    key = "sasl-signing-key-" + secrets.token_hex(8)
    env = sasl_env(sasl_broker, prefix, sasl_broker["password"], key)
    log = tmp_path / "worker.log"
    # -vv: DEBUG from spikeguard and kafka-python alike, where client configurations are logged.
    worker = subprocess.Popen(
        [sys.executable, "-m", "spikeguard", "-vv", "worker", "all"],
        env={**os.environ, **env},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while "spikeguard worker:" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with caplog.at_level(logging.DEBUG):
            runtime = open_runtime(load_settings())
            assert runtime.bus is not None, runtime.problem
            guard, corrupted = e2e.train(tmp_path, "sasl-run", runtime=runtime)
            e2e.wait_for_the_applied_acks(runtime.bus, runtime.topics, "sasl-run", wait_until)
            e2e.check_the_loop_closed(runtime.bus, runtime.topics, guard, corrupted, "sasl-run")
            shown = (
                repr(runtime.bus) + repr(runtime.settings) + str(runtime.settings) + repr(runtime)
            )
            runtime.close()
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
    text = log.read_text()
    assert "SASL" in text or "sasl" in text  # the DEBUG log did talk about the connection
    password = sasl_broker["password"]
    assert password not in text and key not in text
    assert password not in caplog.text and key not in caplog.text
    assert password not in shown and key not in shown
    assert worker.returncode == 0, text[-3000:]


def test_a_wrong_password_is_reported_without_either_password(
    sasl_broker, tmp_path, monkeypatch, caplog
):
    from spikeguard.bus.kafka import KafkaBus
    from spikeguard.errors import BusError

    wrong = "wrong-" + secrets.token_hex(12)
    for name, value in sasl_env(sasl_broker, "sasl-wrong.", wrong, "k" * 32).items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG):
        runtime = open_runtime(load_settings())
    assert runtime.bus is None and runtime.problem  # the trainer goes on locally, and says why
    settings = runtime.settings
    bus = KafkaBus(
        settings.bootstrap_servers,
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=settings.sasl_password,
        ssl_cafile=settings.ssl_cafile,
    )
    with pytest.raises(BusError) as caught:
        bus.probe(5.0)
    shown = " ".join(
        [
            runtime.problem,
            str(caught.value),
            repr(caught.value),
            repr(bus),
            repr(bus._config()),
            caplog.text,
            repr(settings),
        ]
    )
    assert "Authentication" in shown or "authentication" in shown or "SASL" in shown
    for secret in (wrong, sasl_broker["password"]):
        assert secret not in shown


def test_the_confluent_client_round_trips_over_sasl_ssl_without_showing_the_password(
    sasl_broker, caplog
):
    """The librdkafka names of the same settings (sasl.*, ssl.ca.location) reach a SCRAM-over-TLS broker."""
    from spikeguard.bus.confluent import ConfluentBus

    password = sasl_broker["password"]
    bus = ConfluentBus(
        sasl_broker["bootstrap"],
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=password,
        ssl_cafile=sasl_broker["cafile"],
    )
    topic = f"sasl-confluent-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.DEBUG):
        bus.create_topics([topic])
        producer = bus.producer()
        producer.publish(topic, b"over-tls", key="run-1", headers=[("h", b"1")])
        producer.close()
        consumer = bus.consumer(f"g-{uuid.uuid4().hex[:6]}", [topic])
        try:
            deadline, records = time.monotonic() + 60, []
            while not records and time.monotonic() < deadline:
                records = consumer.poll(timeout=0.5)
            consumer.commit()
        finally:
            consumer.close()
    assert [(r.key, r.value, r.headers) for r in records] == [
        (b"run-1", b"over-tls", (("h", b"1"),))
    ]
    assert (
        password not in caplog.text
        and password not in repr(bus)
        and password not in repr(bus._rdkafka_config())
    )
