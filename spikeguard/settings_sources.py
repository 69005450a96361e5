"""Where settings come from besides flags: a config file and ``SPIKEGUARD_*`` variables.

Both are checked against the settings' own fields before anything is
validated, because a misspelt name that is silently dropped leaves a run on a
default its operator thought they had changed: an unknown key in the file, or a
``SPIKEGUARD_*`` variable that names no setting, is a :class:`ConfigError` that
names the key (and the file) and suggests the closest real name.

Some ``SPIKEGUARD_*`` variables are not settings: scripts, tests and the
trainer read them directly. They are listed in :data:`NOT_SETTINGS` and
:data:`NOT_SETTINGS_PREFIXES` (with who reads them) so that they are neither
refused nor mistaken for settings; a new one must be added there.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

from pydantic import BaseModel

from spikeguard.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "SPIKEGUARD_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

# Variables with the prefix that are read by something other than Settings.
NOT_SETTINGS: dict[str, str] = {
    CONFIG_ENV: "names the settings file (same as --config)",
    "SPIKEGUARD_PYTHON": "scripts/*.sh and tests: the interpreter to run",
    "SPIKEGUARD_CACHE": "scripts/*.sh and tests: cache root (Kafka download, venv)",
    "SPIKEGUARD_RUN_ID": "the trainer's Guard: the run id when none is passed",
    "SPIKEGUARD_REQUIRE_KAFKA": "tests: fail, not skip, when no broker is reachable",
    "SPIKEGUARD_PRESET": "the trainer's Guard: the preset when none is passed (producers/run_plan.py)",
}
NOT_SETTINGS_PREFIXES: dict[str, str] = {
    # (SPIKEGUARD_KAFKA_CLIENT is the kafka_client setting: a real setting wins over a prefix)
    "SPIKEGUARD_KAFKA_": "scripts/kafka_local.sh: the local broker (ports, heap, TLS, timeouts)",
    "SPIKEGUARD_TEST_": "tests and benchmarks (e.g. SPIKEGUARD_TEST_BOOTSTRAP)",
}

YAML_SUFFIXES = (".yaml", ".yml")


def is_other_variable(name: str) -> bool:
    """A ``SPIKEGUARD_*`` variable that something other than Settings reads."""
    return name in NOT_SETTINGS or any(name.startswith(p) for p in NOT_SETTINGS_PREFIXES)


def _component(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The nested config model behind field ``name``, or None for a plain value."""
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def setting_names(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every dotted name a value can be given under: components and their fields."""
    for name in model.model_fields:
        yield prefix + name
        component = _component(model, name)
        if component is not None:
            yield from setting_names(component, f"{prefix}{name}.")


def closest_setting(model: type[BaseModel], dotted: str) -> str | None:
    """The real dotted name ``dotted`` was most likely meant to be, if one is close.

    Within a component that does exist only its own fields are compared, so a
    long shared prefix (``statistical.``) does not make every field look close.
    """
    parts = dotted.split(".")
    head = ".".join(parts[:-1])
    known = len(parts) > 1 and unknown_part(model, head) is None
    component = _component_at(model, head) if known else None
    if component is not None:
        fields = list(component.model_fields)
        close = difflib.get_close_matches(parts[-1], fields, n=1, cutoff=0.7)
        return f"{head}.{close[0]}" if close else None
    close = difflib.get_close_matches(dotted, list(setting_names(model)), n=1, cutoff=0.8)
    return close[0] if close else None


def unknown_part(model: type[BaseModel], dotted: str) -> str | None:
    """None if ``dotted`` names a setting (or a whole component), else the dotted prefix that does not."""
    parts = dotted.split(".")
    current: type[BaseModel] | None = model
    for depth, part in enumerate(parts):
        if current is None or part not in current.model_fields:
            return ".".join(parts[: depth + 1])
        current = _component(current, part)
    return None


def check_dotted(model: type[BaseModel], dotted: str, where: str) -> None:
    """Refuse a dotted name (a --set flag, a file key) that names no setting."""
    if unknown_part(model, dotted) is not None:
        close = closest_setting(model, dotted)
        raise ConfigError(
            f"{where}: unknown setting '{dotted}'"
            + (f" (did you mean '{close}'?)" if close else "")
        )


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.upper().replace(".", "__")


def settings_from_env(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, str]:
    """``{dotted name: raw value}`` of the ``SPIKEGUARD_*`` settings variables in ``env``.

    Every other ``SPIKEGUARD_*`` variable is either allow-listed or an error;
    all the wrong ones are named at once, so one run fixes them all.
    """
    found: dict[str, str] = {}
    wrong: list[str] = []
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = name[len(ENV_PREFIX) :].lower().replace("__", ".")
        if (
            unknown_part(model, dotted) is None
        ):  # a setting, even under a reserved prefix (KAFKA_CLIENT)
            found[dotted] = value
            continue
        if is_other_variable(name):
            continue
        close = closest_setting(model, dotted)
        if close is not None:
            hint = f" (did you mean {env_name(close)}?)"
        else:  # perhaps one of the variables scripts and tests read
            other = difflib.get_close_matches(name, list(NOT_SETTINGS), n=1, cutoff=0.8)
            hint = f" (did you mean {other[0]}?)" if other else ""
        wrong.append(f"{name}: no setting '{dotted}'{hint}")
    if wrong:
        raise ConfigError(
            "unknown SPIKEGUARD_* variable: "
            + "; ".join(sorted(wrong))
            + " (variables read by scripts and tests are listed in spikeguard/settings_sources.py)"
        )
    return found


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a TOML (or, with pyyaml installed, YAML) settings file."""
    path = Path(path)
    where = f"config file {path}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{where}: not found") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"{where}: YAML needs pyyaml (pip install 'spikeguard[yaml]'), or use TOML"
            ) from None
        try:
            data = yaml.safe_load(raw.decode("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None
        data = {} if data is None else data  # an empty file sets nothing
    elif path.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: not valid TOML: {' '.join(str(exc).split())}") from None
    else:
        raise ConfigError(f"{where}: unknown format; name it *.toml, *.yaml or *.yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a table of settings, got {type(data).__name__}")
    return data


def flatten_file(
    model: type[BaseModel], data: Mapping[str, Any], where: str, prefix: str = ""
) -> dict[str, Any]:
    """``{dotted name: value}`` from a file's nested tables, refusing unknown keys."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        check_dotted(model, dotted, where)
        component = _component_at(model, dotted)
        if component is not None and isinstance(value, Mapping):
            flat.update(flatten_file(model, value, where, prefix=dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _component_at(model: type[BaseModel], dotted: str) -> type[BaseModel] | None:
    current: type[BaseModel] | None = model
    for part in dotted.split("."):
        if current is None:
            return None
        current = _component(current, part)
    return current
