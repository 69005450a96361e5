"""deploy/: the rules pass promtool, and every metric the dashboard and the rules use exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.metrics_http import LagCollector

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "spikeguard-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "spikeguard.json"
# Series Prometheus makes itself.
BUILTIN = {"up", "ALERTS", "ALERTS_FOR_STATE"}
ALERTS = {"SpikeguardCriticalDecision", "SpikeguardRunHealthCritical", "SpikeguardWorkerDown",
          "SpikeguardConsumerLagHigh", "SpikeguardDeadLettersGrowing", "SpikeguardRunSilent",
          "SpikeguardTrainerWritesFailing"}


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (scripts/test.sh does it)"
    return found


def exposed_names() -> dict[str, set[str]]:
    """Every series name spikeguard can expose -> its label names."""
    registry = CollectorRegistry()
    Metrics(registry)
    registry.register(LagCollector.for_bus(EmbeddedBus()))
    names: dict[str, set[str]] = {}
    for family in registry.collect():
        labels = set(getattr(registry._names_to_collectors.get(family.name), "_labelnames", ()))
        if family.name == "spikeguard_consumer_lag_records":
            labels = {"group", "topic", "partition"}
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(
            family.type, [""])
        for suffix in suffixes:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return names


def expressions() -> list[tuple[str, str]]:
    found = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            found.append((f"rule {rule['alert']}", rule["expr"]))
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        found.append((f"variable {variable['name']}", variable["definition"]))
    for annotation in dashboard["annotations"]["list"]:
        found.append((f"annotation {annotation['name']}", annotation["expr"]))
    return found


def test_promtool_checks_and_unit_tests_the_rules():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "7 rules found" in check.stdout
    unit = subprocess.run([tool, "test", "rules", "spikeguard-alerts.test.yml"],
                          cwd=RULES.parent, capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    config = subprocess.run([tool, "check", "config", "prometheus.yml"], cwd=RULES.parent,
                            capture_output=True, text=True)
    assert config.returncode == 0, config.stdout + config.stderr


def test_the_rules_cover_every_alert_the_issue_asks_for():
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_metric_name_used_by_the_dashboard_and_the_rules_exists():
    names = exposed_names()
    used = 0
    for where, expr in expressions():
        for metric, selector in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
            if not metric.startswith("spikeguard_"):
                continue
            used += 1
            assert metric in names, f"{where}: {metric} is not a spikeguard metric"
            for label in re.findall(r"(\w+)\s*[=!]~?", selector or ""):
                assert label in names[metric], f"{where}: {metric} has no label {label!r}"
    assert used > 30


def test_the_dashboard_is_provisioned_against_the_provisioned_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((DEPLOY / "grafana" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    provider = yaml.safe_load((DEPLOY / "grafana" / "dashboards" / "provider.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/provisioning/dashboards"
    titles = [p["title"] for p in dashboard["panels"]]
    for wanted in ("Runs", "Loss", "Gradient norm", "Anomalous verdicts by detector",
                   "Decisions by urgency", "Actions by kind", "Health", "Throughput (records/s)",
                   "Decision latency and action round trip", "Consumer lag (records)"):
        assert wanted in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid
            assert panel["targets"]


def _panel(dashboard: dict, title: str) -> dict:
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title]
    return panel


def test_each_run_shows_its_lr_and_the_data_skipped_beside_its_loss():
    """What the policy changed for the rest of the run: the LR and the data dropped, per run."""
    dashboard = json.loads(DASHBOARD.read_text())
    panel = _panel(dashboard, "LR and data skipped")
    exprs = [t["expr"] for t in panel["targets"]]
    assert any(e.startswith("max by (run_id) (spikeguard_run_lr{") for e in exprs)
    assert any(e.startswith("max by (run_id) (spikeguard_run_batches_skipped_total{") for e in exprs)
    assert all('run_id=~"$run_id"' in e for e in exprs)
    loss = _panel(dashboard, "Loss")
    assert panel["gridPos"]["y"] == loss["gridPos"]["y"] + loss["gridPos"]["h"]  # right below it


def test_actions_are_one_annotation_per_plan_at_the_time_they_were_issued():
    """A rollback with its skip, LR cut and clip is one mark, not four on top of each other,
    placed at the time the series holds (the issue time), not at each scrape that still sees it."""
    dashboard = json.loads(DASHBOARD.read_text())
    (actions,) = [a for a in dashboard["annotations"]["list"] if a["name"] == "actions"]
    assert actions["useValueForTime"] is True
    assert re.fullmatch(r"max by \(run_id, kinds\) \(spikeguard_run_last_actions_timestamp_seconds"
                        r'\{run_id=~"\$run_id"\}\) \* 1000', actions["expr"])  # Grafana wants ms
    assert "{{kinds}}" in actions["titleFormat"]


def test_panels_do_not_overlap_on_the_grid():
    dashboard = json.loads(DASHBOARD.read_text())
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
