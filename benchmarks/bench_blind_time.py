"""Blind time after ``kill -9`` of a pipeline worker and its immediate restart, on a real broker.

    SPIKEGUARD_TEST_BOOTSTRAP=127.0.0.1:9092 python benchmarks/bench_blind_time.py [--json out.json]

Runs ``spikeguard worker all`` on a steady stream of one run's steps (20/s),
kills it with SIGKILL, restarts it at once, and reports the seconds from the
kill to the first decision the new process produced, for three settings:

- ``dynamic, 45 s session``: kafka-python's defaults;
- ``dynamic, 10 s session``: spikeguard's default session, no instance id;
- ``static membership``: ``SPIKEGUARD_INSTANCE_ID`` set (and the 10 s session).

The restart itself (Python and torch imports, state restore) is part of every
figure. A benchmark, not a test: it reports, it does not fail. It uses the
measuring code of tests/integration/test_blind_time.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {
    "dynamic, 45 s session": {
        "SPIKEGUARD_SESSION_TIMEOUT_S": "45",
        "SPIKEGUARD_HEARTBEAT_INTERVAL_S": "3",
    },
    "dynamic, 10 s session": {},
    "static membership": {"SPIKEGUARD_INSTANCE_ID": "bench-blind"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bootstrap", default=os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP", "127.0.0.1:9092")
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location(
        "blind", HERE.parent / "tests" / "integration" / "test_blind_time.py"
    )
    assert spec is not None and spec.loader is not None  # a .py file that exists: a loader
    blind = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blind)
    results = {}
    for name, env in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            seconds = blind.blind_time_after_kill(args.bootstrap, Path(tmp), env, limit=300)
        results[name] = round(seconds, 1)
        print(f"{name:24s} blind for {seconds:5.1f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
