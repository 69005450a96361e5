"""Settings: flags over SPIKEGUARD_* variables over defaults; bad values name their field."""

import json
import os
import re
from pathlib import Path

import pytest

from spikeguard.cli import main
from spikeguard.errors import ConfigError
from spikeguard.settings import Settings, load_settings, parse_assignments
from spikeguard.settings_sources import (
    NOT_SETTINGS,
    NOT_SETTINGS_PREFIXES,
    is_other_variable,
    unknown_part,
)


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
    assert parse_assignments(["fusion.threshold=0.5", 'fusion.expected=["rules"]']) == {
        "fusion.threshold": "0.5",
        "fusion.expected": ["rules"],
    }
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_assignments(["oops"])


def test_static_membership_and_session_settings():
    settings = load_settings(
        env={"SPIKEGUARD_INSTANCE_ID": "fusion-0", "SPIKEGUARD_SESSION_TIMEOUT_S": "12"}
    )
    assert settings.instance_id == "fusion-0" and settings.session_timeout_s == 12.0
    assert load_settings(env={}).session_timeout_s <= 10.0  # a dead member is noticed within 10 s
    with pytest.raises(ConfigError, match="instance_id"):
        load_settings(env={"SPIKEGUARD_INSTANCE_ID": "has space"})
    with pytest.raises(ConfigError, match="a third of session_timeout_s"):
        load_settings({"heartbeat_interval_s": 5, "session_timeout_s": 10}, env={})


def test_the_kafka_bus_gets_membership_settings_and_numbers_static_members():
    from spikeguard.runtime import make_bus

    bus = make_bus(
        load_settings(
            {
                "bootstrap_servers": "broker.invalid:9092",
                "instance_id": "w1",
                "session_timeout_s": 8,
                "heartbeat_interval_s": 2,
            },
            env={},
        )
    )
    assert (bus.instance_id, bus.session_timeout_ms, bus.heartbeat_interval_ms) == (
        "w1",
        8000,
        2000,
    )
    # One name per consumer of a group, in opening order: a restarted process repeats them.
    assert [bus._static_member("g") for _ in range(3)] == ["w1", "w1-2", "w1-3"]
    assert bus._static_member("other") == "w1"


# --- a config file, a mistyped variable, `spikeguard settings` ---------------

REPO = Path(__file__).resolve().parents[2]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_a_toml_file_sits_under_the_environment_and_flags(tmp_path):
    config = _write(
        tmp_path / "spikeguard.toml",
        """
partitions = 3
topic_prefix = "from-file."
[fusion]
threshold = 0.3
[policy]
skip_extra_batches = 11
[statistical.loss]
warmup = 45
""",
    )
    env = {"SPIKEGUARD_FUSION__THRESHOLD": "0.4"}
    settings = load_settings({"partitions": 2}, env=env, config_file=config)
    assert settings.partitions == 2  # flag > file
    assert settings.fusion.threshold == 0.4  # env > file
    assert settings.topic_prefix == "from-file."  # file > default
    assert settings.policy.skip_extra_batches == 11 and settings.statistical.loss.warmup == 45
    assert settings.session_timeout_s == 10.0  # untouched: the default
    # Without the file the same call gives the defaults back.
    assert load_settings(env={}).topic_prefix == "spikeguard."


def test_the_file_can_be_named_by_SPIKEGUARD_CONFIG(tmp_path, monkeypatch):
    config = _write(tmp_path / "c.toml", 'client_id = "named-by-env"\n')
    assert load_settings(env={"SPIKEGUARD_CONFIG": str(config)}).client_id == "named-by-env"
    monkeypatch.setenv("SPIKEGUARD_CONFIG", str(config))
    assert (
        load_settings().client_id == "named-by-env"
    )  # the process environment, as the Guard loads it
    other = _write(tmp_path / "other.toml", 'client_id = "the-flag-wins"\n')
    assert load_settings(config_file=other).client_id == "the-flag-wins"


def test_a_yaml_file_works_too(tmp_path):
    pytest.importorskip("yaml")
    config = _write(
        tmp_path / "c.yaml",
        "partitions: 5\nfusion:\n  threshold: 0.25\nalerting:\n  min_urgency: critical\n",
    )
    settings = load_settings(env={}, config_file=config)
    assert settings.partitions == 5 and settings.fusion.threshold == 0.25
    assert settings.alerting.min_urgency.value == "critical"
    assert load_settings(env={}, config_file=_write(tmp_path / "empty.yml", "")).partitions == 4


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: d / "missing.toml", "not found"),
        (lambda d: d, "cannot read it"),  # a directory
        (lambda d: _write(d / "bad.toml", "partitions = = 3\n"), "not valid TOML"),
        (lambda d: _write(d / "bad.yaml", "a: [1,\n  b: }\n"), "not valid YAML"),
        (lambda d: _write(d / "list.yaml", "- 1\n- 2\n"), "expected a table"),
        (lambda d: _write(d / "settings.ini", "partitions=3\n"), "*.toml, *.yaml or *.yml"),
    ],
)
def test_a_file_that_cannot_be_used_is_a_one_line_error_naming_it(tmp_path, make, says):
    if "YAML" in says or "table" in says:
        pytest.importorskip("yaml")
    path = make(tmp_path)
    with pytest.raises(ConfigError) as caught:
        load_settings(env={}, config_file=path)
    message = str(caught.value)
    assert f"config file {path}" in message and says in message
    assert "\n" not in message


def test_an_unreadable_file_is_an_error(tmp_path):
    path = _write(tmp_path / "secret.toml", "partitions = 3\n")
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads everything
        pytest.skip("running as root: no file is unreadable")
    with pytest.raises(ConfigError, match=rf"config file {re.escape(str(path))}: cannot read it"):
        load_settings(env={}, config_file=path)


def test_an_unknown_key_in_the_file_names_the_file_and_the_key(tmp_path):
    path = _write(tmp_path / "c.toml", "[fusion]\ntreshold = 0.5\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(env={}, config_file=path)
    assert str(caught.value) == (
        f"config file {path}: unknown setting 'fusion.treshold' (did you mean 'fusion.threshold'?)"
    )
    path = _write(tmp_path / "top.toml", "partition = 3\n[no_such_component]\nx = 1\n")
    with pytest.raises(
        ConfigError, match=r"unknown setting 'partition' \(did you mean 'partitions'\?\)"
    ):
        load_settings(env={}, config_file=path)
    # A table where a plain value belongs is a wrong value, named with its file.
    path = _write(tmp_path / "deep.toml", "[partitions]\nx = 1\n")
    with pytest.raises(ConfigError, match=rf"partitions \(config file {re.escape(str(path))}\)"):
        load_settings(env={}, config_file=path)
    # The environment's nested names are checked the same way.
    with pytest.raises(ConfigError, match=r"SPIKEGUARD_PARTITIONS__X: no setting 'partitions.x'"):
        load_settings(env={"SPIKEGUARD_PARTITIONS__X": "1"})


def test_a_bad_value_in_the_file_names_the_file(tmp_path):
    path = _write(tmp_path / "c.toml", "partitions = 0\n[fusion]\nthreshold = 'high'\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(env={}, config_file=path)
    assert f"partitions (config file {path})" in str(caught.value)
    assert f"fusion.threshold (config file {path})" in str(caught.value)


def test_secrets_from_the_file_work_and_never_show(tmp_path):
    path = _write(
        tmp_path / "c.toml",
        'signing_key = "f1le-k3y"\nsasl_password = "hunter2"\n'
        '[guard]\nsigning_key = "gu4rd-k3y"\n'
        '[alerting]\nsmtp_password = "sm7p"\n',
    )
    settings = load_settings(env={}, config_file=path)
    assert settings.signing_key.get_secret_value() == "f1le-k3y"
    assert settings.guard.signing_key.get_secret_value() == "gu4rd-k3y"
    assert settings.alerting.smtp_password.get_secret_value() == "sm7p"
    text = repr(settings) + str(settings) + settings.model_dump_json()
    for secret in ("f1le-k3y", "hunter2", "gu4rd-k3y", "sm7p"):
        assert secret not in text
    # An empty key in the file is no key, as in the environment.
    empty = _write(tmp_path / "e.toml", 'signing_key = ""\n')
    assert load_settings(env={}, config_file=empty).signing_key is None


def test_a_mistyped_variable_is_an_error_that_suggests_the_right_name():
    with pytest.raises(ConfigError) as caught:
        load_settings(env={"SPIKEGUARD_FUSON__THRESHOLD": "0.5"})
    message = str(caught.value)
    assert "SPIKEGUARD_FUSON__THRESHOLD" in message
    assert "did you mean SPIKEGUARD_FUSION__THRESHOLD?" in message and "\n" not in message
    with pytest.raises(ConfigError, match="did you mean SPIKEGUARD_BOOTSTRAP_SERVERS"):
        load_settings(env={"SPIKEGUARD_BOOTSTRAP_SERVER": "kafka:9092"})
    with pytest.raises(ConfigError, match="did you mean SPIKEGUARD_POLICY__SKIP_EXTRA_BATCHES"):
        load_settings(env={"SPIKEGUARD_POLICY__SKIP_EXTRA_BATCH": "3"})
    # Nothing close: named, no guess. Every wrong one is named at once.
    with pytest.raises(ConfigError) as caught:
        load_settings(env={"SPIKEGUARD_ZZZ": "1", "SPIKEGUARD_FUSON__THRESHOLD": "0.5"})
    assert "SPIKEGUARD_ZZZ: no setting 'zzz'" in str(caught.value)
    assert "SPIKEGUARD_FUSON__THRESHOLD" in str(caught.value)
    # A whole component as JSON is a setting too.
    assert load_settings(env={"SPIKEGUARD_FUSION": '{"threshold": 0.6}'}).fusion.threshold == 0.6


def test_a_mistyped_flag_suggests_the_right_name():
    with pytest.raises(
        ConfigError, match=r"flag fusion.treshold: .*did you mean 'fusion.threshold'"
    ):
        load_settings({"fusion.treshold": 0.5}, env={})


def test_variables_read_by_scripts_and_tests_are_allowed():
    env = {name: "1" for name in NOT_SETTINGS}
    env.update({prefix + "ANYTHING": "1" for prefix in NOT_SETTINGS_PREFIXES})
    env.update(
        {
            "SPIKEGUARD_KAFKA_PORT": "10192",
            "SPIKEGUARD_TEST_BOOTSTRAP": "127.0.0.1:10192",
            "SPIKEGUARD_KAFKA_SASL_PORT": "10194",
            "SPIKEGUARD_INSECURE": "1",
        }
    )
    env.pop("SPIKEGUARD_CONFIG")  # names a file: tested above
    assert load_settings(env=env).insecure is True


def test_every_SPIKEGUARD_variable_the_repo_sets_is_a_setting_or_allow_listed():
    """Compose, the Dockerfile, deploy/, scripts/, tests and benchmarks: none may break Settings."""
    files = [REPO / "docker-compose.yml", REPO / "Dockerfile", REPO / "tests" / "conftest.py"]
    for folder in ("deploy", "scripts", "benchmarks", "tests/integration"):
        files += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix != ".pyc"]
    names = set()
    for path in files:
        if path.exists():
            names.update(
                re.findall(r"SPIKEGUARD_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace"))
            )
    assert (
        "SPIKEGUARD_SIGNING_KEY" in names and "SPIKEGUARD_KAFKA_PORT" in names
    )  # the scan sees them
    for name in sorted(names):
        dotted = name[len("SPIKEGUARD_") :].lower().replace("__", ".")
        assert is_other_variable(name) or unknown_part(Settings, dotted) is None, name


def test_settings_command_shows_each_value_and_where_it_came_from(tmp_path, monkeypatch, capsys):
    path = _write(
        tmp_path / "c.toml",
        'partitions = 3\nsigning_key = "f1le-k3y"\n'
        "[fusion]\nthreshold = 0.3\n[policy]\nskip_extra_batches = 9\n",
    )
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        if not is_other_variable(name):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPIKEGUARD_FUSION__THRESHOLD", "0.4")
    assert (
        main(
            [
                "settings",
                "--json",
                "--config",
                str(path),
                "--set",
                "policy.skip_extra_batches=12",
                "--topic-prefix",
                "t.",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "f1le-k3y" not in out
    rows = {row["name"]: row for row in map(json.loads, out.splitlines())}
    assert rows["partitions"] == {"name": "partitions", "value": 3, "source": f"config file {path}"}
    assert rows["fusion.threshold"]["value"] == 0.4
    assert rows["fusion.threshold"]["source"] == "environment variable SPIKEGUARD_FUSION__THRESHOLD"
    assert rows["policy.skip_extra_batches"] == {
        "name": "policy.skip_extra_batches",
        "value": 12,
        "source": "flag policy.skip_extra_batches",
    }
    assert rows["topic_prefix"]["source"] == "flag topic_prefix"
    assert rows["signing_key"] == {
        "name": "signing_key",
        "value": "**********",
        "source": f"config file {path}",
    }
    assert rows["session_timeout_s"] == {
        "name": "session_timeout_s",
        "value": 10.0,
        "source": "default",
    }
    assert (
        rows["statistical.loss.warmup"]["source"] == "default"
    )  # nested components are listed leaf by leaf
    assert main(["settings", "--changed", "--config", str(path)]) == 0
    changed = capsys.readouterr().out.splitlines()
    assert len(changed) == 4 and all("default)" not in line for line in changed)


def test_commands_refuse_a_bad_file_or_variable_in_one_line(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope.toml"
    assert (
        main(["backtest", str(tmp_path / "steps.csv"), "--out", "-", "--config", str(missing)]) == 2
    )
    err = capsys.readouterr().err
    assert err == f"spikeguard backtest: config file {missing}: not found\n"
    monkeypatch.setenv("SPIKEGUARD_FUSON__THRESHOLD", "0.5")
    assert main(["settings"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean SPIKEGUARD_FUSION__THRESHOLD" in err


def test_the_demo_tunes_its_policy_unless_the_file_or_environment_says_otherwise(
    tmp_path, monkeypatch
):
    from spikeguard.cli.demo import demo_settings
    from spikeguard.demo.run import DEMO_SETTINGS

    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        if not is_other_variable(name):
            monkeypatch.delenv(name)
    monkeypatch.delenv("SPIKEGUARD_CONFIG", raising=False)
    tuned = DEMO_SETTINGS["policy.lr_restore_healthy_steps"]
    assert demo_settings().policy.lr_restore_healthy_steps == tuned
    path = _write(tmp_path / "demo.toml", "[policy]\nlr_restore_healthy_steps = 7\n")
    settings = demo_settings(str(path))
    assert settings.policy.lr_restore_healthy_steps == 7
    assert settings.policy.clip_mode == DEMO_SETTINGS["policy.clip_mode"]  # the rest stays tuned
    monkeypatch.setenv("SPIKEGUARD_POLICY__LR_RESTORE_HEALTHY_STEPS", "5")
    assert demo_settings(str(path)).policy.lr_restore_healthy_steps == 5


def test_the_demo_command_takes_config(tmp_path, capsys):
    path = _write(tmp_path / "demo.toml", "[policy]\nskip_extra_batchs = 7\n")
    assert main(["demo", "--steps", "150", "--plot", "", "--quiet", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"spikeguard demo: config file {path}: unknown setting 'policy.skip_extra_batchs' "
        "(did you mean 'policy.skip_extra_batches'?)\n"
    )


def test_settings_changed_says_all_defaults_when_nothing_is_changed(monkeypatch, capsys):
    for name in [n for n in os.environ if n.startswith("SPIKEGUARD_")]:
        if not is_other_variable(name):
            monkeypatch.delenv(name)
    assert main(["settings", "--changed"]) == 0
    assert capsys.readouterr().out.startswith("all defaults")
    assert main(["settings", "--changed", "--json"]) == 0
    assert capsys.readouterr().out == ""  # machine output: no rows
