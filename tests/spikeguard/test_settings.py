"""Settings: flags over SPIKEGUARD_* variables over defaults; bad values name their field."""

import pytest

from spikeguard.errors import ConfigError
from spikeguard.settings import load_settings, parse_assignments


def test_defaults_are_the_embedded_bus():
    settings = load_settings(env={})
    assert settings.engine == "embedded" and settings.topic_prefix == "spikeguard."


def test_environment_overrides_defaults_and_flags_override_the_environment():
    env = {
        "SPIKEGUARD_BOOTSTRAP_SERVERS": "kafka:9092",
        "SPIKEGUARD_FUSION__THRESHOLD": "0.42",
        "SPIKEGUARD_PARTITIONS": "8",
        "SPIKEGUARD_KAFKA_PORT": "9999",  # a script's variable, not a setting: ignored
    }
    settings = load_settings({"partitions": 2}, env=env)
    assert settings.engine == "kafka" and settings.bootstrap_servers == "kafka:9092"
    assert settings.fusion.threshold == 0.42
    assert settings.partitions == 2


def test_a_bad_value_names_the_field_and_where_it_came_from():
    with pytest.raises(ConfigError) as caught:
        load_settings(env={"SPIKEGUARD_FUSION__THRESHOLD": "high"})
    assert "fusion.threshold" in str(caught.value)
    assert "SPIKEGUARD_FUSION__THRESHOLD" in str(caught.value)
    with pytest.raises(ConfigError, match=r"partitions \(flag partitions\)"):
        load_settings({"partitions": 0}, env={})


def test_an_unknown_component_field_is_refused():
    with pytest.raises(ConfigError, match="statistical.no_such_knob"):
        load_settings(env={"SPIKEGUARD_STATISTICAL__NO_SUCH_KNOB": "1"})


def test_secrets_never_show_in_reprs():
    settings = load_settings(
        env={"SPIKEGUARD_SASL_PASSWORD": "hunter2", "SPIKEGUARD_SIGNING_KEY": "k3y-s3cret"}
    )
    text = repr(settings) + str(settings) + settings.model_dump_json()
    assert "hunter2" not in text and "k3y-s3cret" not in text
    assert settings.sasl_password.get_secret_value() == "hunter2"


def test_set_flags_parse_json_values():
    assert parse_assignments(["fusion.threshold=0.5", "fusion.expected=[\"rules\"]"]) == {
        "fusion.threshold": "0.5",
        "fusion.expected": ["rules"],
    }
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_assignments(["oops"])


def test_static_membership_and_session_settings():
    settings = load_settings(env={"SPIKEGUARD_INSTANCE_ID": "fusion-0", "SPIKEGUARD_SESSION_TIMEOUT_S": "12"})
    assert settings.instance_id == "fusion-0" and settings.session_timeout_s == 12.0
    assert load_settings(env={}).session_timeout_s <= 10.0  # a dead member is noticed within 10 s
    with pytest.raises(ConfigError, match="instance_id"):
        load_settings(env={"SPIKEGUARD_INSTANCE_ID": "has space"})
    with pytest.raises(ConfigError, match="a third of session_timeout_s"):
        load_settings({"heartbeat_interval_s": 5, "session_timeout_s": 10}, env={})


def test_the_kafka_bus_gets_membership_settings_and_numbers_static_members():
    from spikeguard.runtime import make_bus

    bus = make_bus(load_settings({"bootstrap_servers": "broker.invalid:9092", "instance_id": "w1",
                                  "session_timeout_s": 8, "heartbeat_interval_s": 2}, env={}))
    assert (bus.instance_id, bus.session_timeout_ms, bus.heartbeat_interval_ms) == ("w1", 8000, 2000)
    # One name per consumer of a group, in opening order: a restarted process repeats them.
    assert [bus._static_member("g") for _ in range(3)] == ["w1", "w1-2", "w1-3"]
    assert bus._static_member("other") == "w1"
