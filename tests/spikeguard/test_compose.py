"""docker-compose.yml only runs commands the CLI really has."""

import json
import re
from pathlib import Path

import pytest

from spikeguard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def compose_commands():
    text = (ROOT / "docker-compose.yml").read_text()
    return [json.loads(m) for m in re.findall(r"^\s*command:\s*(\[.*\])\s*$", text, re.M)]


def test_compose_defines_a_worker_for_every_component():
    from spikeguard.components import COMPONENTS

    names = {cmd[2] for cmd in compose_commands() if cmd[:2] == ["spikeguard", "worker"]}
    assert names == set(COMPONENTS)


@pytest.mark.parametrize("command", compose_commands(), ids=lambda c: " ".join(c[1:3]))
def test_every_compose_command_parses(command):
    assert command[0] == "spikeguard"
    args = build_parser().parse_args(command[1:])
    assert callable(args.func)


# -- the file's shape: `docker compose config` is not available here, so a schema -------
# A JSON Schema of the Compose keys this project uses (after the Compose
# specification): unknown keys, misspelt keys and wrong shapes are errors.
_STRINGS = {"type": "array", "items": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
_HEALTHCHECK = {
    "type": "object",
    "additionalProperties": False,
    "required": ["test"],
    "properties": {
        "test": {
            "type": "array",
            "minItems": 2,
            "items": {"type": "string"},
            "prefixItems": [{"enum": ["CMD", "CMD-SHELL", "NONE"]}],
        },
        "interval": _DURATION,
        "timeout": _DURATION,
        "start_period": _DURATION,
        "retries": {"type": "integer", "minimum": 1},
    },
}
_SERVICE = {
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
    "properties": {
        "image": {"type": "string"},
        "build": {"type": "string"},
        "command": _STRINGS,
        "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
        "ports": {"type": "array", "items": {"type": "string", "pattern": r"^\d+(:\d+)?$"}},
        "expose": {"type": "array", "items": {"type": "string", "pattern": r"^\d+$"}},
        "environment": {
            "type": "object",
            "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
        },
        "volumes": {
            "type": "array",
            "items": {"type": "string", "pattern": r"^[^:]+:/[^:]*(:ro|:rw)?$"},
        },
        "depends_on": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["condition"],
                "properties": {
                    "condition": {
                        "enum": [
                            "service_started",
                            "service_healthy",
                            "service_completed_successfully",
                        ]
                    }
                },
            },
        },
        "healthcheck": _HEALTHCHECK,
    },
}
COMPOSE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["services"],
    "patternProperties": {"^x-": {}},
    "properties": {
        "services": {"type": "object", "additionalProperties": _SERVICE},
        "volumes": {"type": "object", "additionalProperties": {"type": ["object", "null"]}},
    },
}


def compose():
    import yaml

    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_matches_the_schema():
    import jsonschema

    jsonschema.validate(compose(), COMPOSE_SCHEMA, cls=jsonschema.Draft202012Validator)


def test_the_schema_catches_the_usual_mistakes():
    import jsonschema

    good = compose()
    broken = [
        {
            **good,
            "services": {
                **good["services"],
                "kafka": {**good["services"]["kafka"], "depend_on": ["x"]},
            },
        },
        {
            **good,
            "services": {
                **good["services"],
                "rules": {
                    **good["services"]["rules"],
                    "depends_on": {"kafka": {"condition": "healthy"}},
                },
            },
        },
        {
            **good,
            "services": {
                **good["services"],
                "kafka": {**good["services"]["kafka"], "healthcheck": {"test": ["RUN", "true"]}},
            },
        },
    ]
    for document in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(document, COMPOSE_SCHEMA, cls=jsonschema.Draft202012Validator)


def test_dependencies_wait_for_health_and_volumes_exist():
    doc = compose()
    services, volumes = doc["services"], doc.get("volumes", {})
    for name, service in services.items():
        for needed, how in service.get("depends_on", {}).items():
            assert needed in services, f"{name} depends on unknown {needed}"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[needed], f"{needed} has no healthcheck"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith("."):
                assert source in volumes, f"{name}: named volume {source} is not declared"
            else:
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
    assert any(v.endswith(":/var/lib/kafka/data") for v in services["kafka"]["volumes"])
    assert services["kafka"]["environment"]["KAFKA_LOG_DIRS"] == "/var/lib/kafka/data"
    assert (
        "${KAFKA_ADVERTISED_HOST:-localhost}"
        in (services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"])
    )


def test_prometheus_discovers_every_service_that_serves_metrics():
    import yaml

    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (dns,) = job["dns_sd_configs"]
    serving = {
        name
        for name, s in compose()["services"].items()
        if "--metrics-port" in s.get("command", [])
    }
    assert set(dns["names"]) == serving and dns["port"] == 9400
    for name in serving:
        assert "--metrics-port" in compose()["services"][name]["command"]


def test_every_worker_gets_the_signing_key_and_none_runs_without_it():
    """Each worker authenticates what it reads (steps, run events) or signs (actions) with the run's key."""
    from spikeguard.components import COMPONENTS

    services = compose()["services"]
    workers = {
        name: s
        for name, s in services.items()
        if s.get("command", [])[:2] == ["spikeguard", "worker"]
    }
    assert {s["command"][2] for s in workers.values()} == set(COMPONENTS)
    for name, service in workers.items():
        env = service.get("environment", {})
        # ${VAR:?message}: compose refuses to start rather than run a worker without the key.
        assert re.fullmatch(
            r"\$\{SPIKEGUARD_SIGNING_KEY:\?[^}]+\}", env.get("SPIKEGUARD_SIGNING_KEY", "")
        ), name
        assert "SPIKEGUARD_INSECURE" not in env and "--insecure" not in service["command"], name
