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
