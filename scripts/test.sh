#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (the venv
# outside the clone, the Kafka jars through Maven), starts the local broker
# unless one is already up, runs pytest, and stops the broker it started.
#   scripts/test.sh [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
venv="$(bash scripts/env.sh)"
# tests/deploy runs promtool and a Prometheus server: Debian's package has both.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq prometheus >&2
fi
started=0
if ! bash scripts/kafka_local.sh status >/dev/null 2>&1; then
  bash scripts/kafka_local.sh start --fresh  # a test run begins with an empty broker
  started=1
fi
cleanup() { if [ "$started" = 1 ]; then bash scripts/kafka_local.sh stop || true; fi; }
trap cleanup EXIT
# Integration tests must not skip silently when the broker is missing.
export SPIKEGUARD_REQUIRE_KAFKA=1
export SPIKEGUARD_PYTHON="$venv/bin/python"
# Three processes (pytest-xdist), on 2 cores too: much of the suite waits on brokers, workers
# and child processes. SPIKEGUARD_TEST_WORKERS=0 runs it in one process. tests/conftest.py puts the
# longest tiers first; a module's tests run in one process (loadscope, in that order), so that a
# module-scoped fixture (a backtest of the synthetic suite, an example's runs) is set up once.
"$venv/bin/python" -m pytest -n "${SPIKEGUARD_TEST_WORKERS:-3}" --dist loadscope --no-loadscope-reorder "$@"
