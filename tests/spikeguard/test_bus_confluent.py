"""The confluent-kafka client (spikeguard.bus.confluent): what the conformance suite cannot say.

Every conformance test of tests/spikeguard/test_bus_conformance.py runs on this
client too (the ``confluent`` engine of its ``bus`` fixture), as do its Kafka
specifics (murmur2 partitioning, flush errors, linger). Here: its settings,
static membership and rebalance callbacks.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from spikeguard.bus.confluent import ConfluentBus
from spikeguard.bus.kafka import KafkaBus


def _conformance():
    """The conformance module's helpers (tests are not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "bus_conformance", Path(__file__).with_name("test_bus_conformance.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


_c = _conformance()
FAST_GROUPS, PARTITIONS = _c.FAST_GROUPS, _c.PARTITIONS
drain, keyed, new_topic, open_consumer, publish, unique, wait_assigned = (
    _c.drain,
    _c.keyed,
    _c.new_topic,
    _c.open_consumer,
    _c.publish,
    _c.unique,
    _c.wait_assigned,
)
stack, _delete_kafka_topics = _c.stack, _c._delete_kafka_topics  # fixtures, used by name


def test_confluent_bus_keeps_secrets_out_of_its_repr_and_config() -> None:
    bus = ConfluentBus(
        "127.0.0.1:1",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password=SecretStr("hunter2"),
        ssl_cafile="/ca.pem",
        ssl_certfile="/cert.pem",
        ssl_keyfile="/key.pem",
    )  # no network in __init__
    config = bus._rdkafka_config()
    assert (
        "hunter2" not in repr(bus) and "hunter2" not in repr(config) and "hunter2" not in str(bus)
    )
    assert config["sasl.password"] == "hunter2" and config["sasl.username"] == "svc"
    assert (config["security.protocol"], config["sasl.mechanism"]) == ("SASL_SSL", "SCRAM-SHA-512")
    assert (
        config["ssl.ca.location"],
        config["ssl.certificate.location"],
        config["ssl.key.location"],
    ) == ("/ca.pem", "/cert.pem", "/key.pem")
    assert bus.engine == "kafka" and bus.client == "confluent"


def test_confluent_clients_try_a_broker_that_went_away_again_within_a_second(monkeypatch) -> None:
    # The same cap as kafka-python's clients (test_bus_conformance.py): librdkafka's own is 10 s.
    import spikeguard.bus.confluent as confluent
    from spikeguard.bus.kafka import RECONNECT_BACKOFF_MAX_MS

    configs: list[dict] = []
    monkeypatch.setattr(confluent, "ConfluentProducer", lambda config: configs.append(config))
    monkeypatch.setattr(
        confluent, "ConfluentConsumer", lambda config, *rest: configs.append(config)
    )
    bus = ConfluentBus("127.0.0.1:1", instance_id="w1", session_timeout_ms=6000)
    bus.producer(), bus.consumer("g", ["t"])  # no network: the clients are not made
    assert [c.get("reconnect.backoff.max.ms") for c in configs] == [RECONNECT_BACKOFF_MAX_MS] * 2
    assert RECONNECT_BACKOFF_MAX_MS <= 1000
    assert (configs[1]["group.instance.id"], configs[1]["session.timeout.ms"]) == ("w1", 6000)


def test_confluent_options_take_kafka_python_or_librdkafka_names() -> None:
    from spikeguard.bus.confluent import librdkafka_options

    assert librdkafka_options(
        {**FAST_GROUPS, "fetch_max_wait_ms": 50, "fetch.min.bytes": 1, "max_poll_records": 10}
    ) == {
        "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 200,
        "max.poll.interval.ms": 20000,
        "fetch.wait.max.ms": 50,
        "fetch.min.bytes": 1,
    }


def test_the_confluent_client_chosen_without_the_package_names_the_extra(monkeypatch) -> None:
    import spikeguard.bus.confluent as confluent
    from spikeguard.errors import ConfigError
    from spikeguard.runtime import make_bus
    from spikeguard.settings import load_settings

    settings = load_settings(
        env={
            "SPIKEGUARD_BOOTSTRAP_SERVERS": "broker.invalid:9092",
            "SPIKEGUARD_KAFKA_CLIENT": "confluent",
        }
    )
    assert type(make_bus(settings)) is ConfluentBus
    assert (
        type(make_bus(load_settings({"bootstrap_servers": "broker.invalid:9092"}, env={})))
        is KafkaBus
    )
    monkeypatch.setattr(confluent, "ck", None)
    with pytest.raises(ConfigError, match=r"spikeguard\[confluent\]"):
        make_bus(settings)


@pytest.mark.kafka
def test_confluent_members_join_with_their_static_names(kafka_bootstrap: str, stack) -> None:
    from kafka import KafkaAdminClient

    bus = ConfluentBus(
        kafka_bootstrap,
        partitions=PARTITIONS,
        consumer_options=FAST_GROUPS,
        instance_id=f"static-{uuid.uuid4().hex[:6]}",
    )
    topic, group = new_topic(bus), unique("group")
    members = [open_consumer(stack, bus, group, topic) for _ in range(2)]
    wait_assigned(members, topic)
    with KafkaAdminClient(bootstrap_servers=kafka_bootstrap) as admin:
        [described] = admin.describe_groups([group]).values()
    names = sorted(m.get("group_instance_id") for m in described["members"])
    assert names == [bus.instance_id, f"{bus.instance_id}-2"]


@pytest.mark.kafka
def test_confluent_on_revoke_hands_over_before_another_member_gets_the_partitions(
    kafka_bootstrap: str, stack
) -> None:
    bus = ConfluentBus(kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS)
    topic, group = new_topic(bus), unique("group")
    revoked: list[set[tuple[str, int]]] = []
    first = open_consumer(stack, bus, group, topic, on_revoke=revoked.append)
    wait_assigned([first], topic)
    second = open_consumer(stack, bus, group, topic)
    wait_assigned([first, second], topic)
    assert revoked and revoked[0] == {
        (topic, p) for p in range(PARTITIONS)
    }  # eager: all, then the split
    assert len(first.assignment()) + len(second.assignment()) == PARTITIONS


@pytest.mark.kafka
def test_confluent_a_failing_rebalance_callback_raises_its_own_error_from_poll(
    kafka_bootstrap: str, stack
) -> None:
    bus = ConfluentBus(kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS)
    topic = new_topic(bus)
    publish(bus, topic, keyed(keys=4, per_key=1))

    def refuse(gained: set[tuple[str, int]]) -> None:
        raise LookupError("no snapshot for these partitions")

    consumer = open_consumer(stack, bus, unique("group"), topic, on_assign=refuse)
    with pytest.raises(LookupError, match="no snapshot"):
        drain(consumer, 4, timeout=30)


@pytest.mark.kafka
@pytest.mark.parametrize("kind", [KafkaBus, ConfluentBus], ids=["kafka-python", "confluent"])
def test_closing_a_member_revokes_its_partitions_on_either_client(
    kafka_bootstrap: str, stack, kind
) -> None:
    """kafka-python (>= 3) calls on_revoke when a member closes, so a worker saves what it owns; so must librdkafka."""
    bus = kind(kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS)
    topic = new_topic(bus)
    revoked: list[set[tuple[str, int]]] = []
    consumer = bus.consumer(unique("group"), [topic], on_revoke=revoked.append)
    try:
        wait_assigned([consumer], topic)
        assert revoked == []
    finally:
        consumer.close()
    assert revoked == [{(topic, p) for p in range(PARTITIONS)}]
