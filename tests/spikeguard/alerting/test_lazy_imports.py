"""The settings read the alerting config only: a trainer that never alerts does not import
the channels' smtplib, ssl and http, nor the notifier's prometheus-client (~40 ms of start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import spikeguard.alerting

HEAVY = (
    "smtplib",
    "ssl",
    "urllib.request",
    "prometheus_client",
    "spikeguard.alerting.channels",
    "spikeguard.alerting.notifier",
)


def _loaded_after(code: str) -> list[str]:
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_settings_do_not_import_the_alert_channels_or_the_notifier():
    assert _loaded_after("import spikeguard.settings") == []


def test_the_alerting_names_load_on_first_use():
    loaded = _loaded_after(
        "from spikeguard.alerting import AlertingConfig, EmailChannel, Notifier\n"
        "from spikeguard.alerting.channels import EmailChannel as E\n"
        "assert EmailChannel is E and AlertingConfig and Notifier"
    )
    assert "spikeguard.alerting.channels" in loaded and "spikeguard.alerting.notifier" in loaded


def test_an_unknown_alerting_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        spikeguard.alerting.Nothing  # noqa: B018
