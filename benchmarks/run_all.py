"""Every benchmark of docs/benchmarks.md's speed table, one after the other, with the time each took.

    python benchmarks/run_all.py [--out DIR] [--bootstrap HOST:PORT] [--only NAME ...] [--list]

Each benchmark runs as its own process with the arguments below (docs/benchmarks.md
gives each row's command; these are the same, sized so that the whole
set takes under 10 minutes on the 2-core machine), its output kept in
``DIR/NAME.txt`` (JSON where the benchmark writes it). The Kafka rows need a
broker: without ``--bootstrap`` the project's own (``scripts/kafka_local.sh
start --fresh``, on ``SPIKEGUARD_KAFKA_PORT``, default 9092) is started
first and stopped at the end. A benchmark that fails is reported and the
others still run; the exit status is 1 if any failed.

A benchmark reports, it does not judge: read each row's figures against its
aim in its output or in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: (name, script, arguments, needs a broker); {out} is the output directory.
BENCHMARKS: list[tuple[str, str, list[str], bool]] = [
    ("backtest", "bench_backtest.py", ["--pairs", "2", "--memory", "--json", "{out}/backtest.json"], False),
    ("growth", "bench_growth.py", ["--json", "{out}/growth.json"], False),
    ("guard_overhead", "bench_guard_overhead.py", ["--steps", "300", "--rounds", "5", "--json"], False),
    ("grad_stats", "bench_grad_stats.py", ["--rounds", "5", "--json", "{out}/grad_stats.json"], False),
    ("embedded_cost", "bench_embedded_cost.py", ["--steps", "2000", "--rounds", "3", "--json"], False),
    ("scale_runs", "bench_scale_runs.py", ["--runs", "2000", "--json"], False),
    ("kafka_throughput", "bench_kafka_throughput.py",
     ["--bootstrap", "{bootstrap}", "--client", "both", "--layout", "both", "--json"], True),
    ("kafka_latency", "bench_kafka_latency.py",
     ["--bootstrap", "{bootstrap}", "--client", "both", "--layout", "cohosted", "--seconds", "15", "--json"], True),
]


def _broker(action: str) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "kafka_local.sh"), *action.split()], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/spikeguard-bench/all", help="where each benchmark's output goes")
    parser.add_argument("--bootstrap", help="a running broker for the Kafka rows (else the project's is started)")
    parser.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHMARKS], help="run these only")
    parser.add_argument("--list", action="store_true", help="print the commands and stop")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in BENCHMARKS if not args.only or b[0] in args.only]
    bootstrap = args.bootstrap or f"127.0.0.1:{os.environ.get('SPIKEGUARD_KAFKA_PORT', '9092')}"
    commands = {
        name: [sys.executable, str(HERE / script), *(a.format(out=out, bootstrap=bootstrap) for a in arguments)]
        for name, script, arguments, _ in chosen
    }
    if args.list:
        for name, command in commands.items():
            print(f"{name}: {' '.join(command)}")
        return 0

    started_broker = False
    if any(kafka for *_, kafka in chosen) and not args.bootstrap:
        _broker("start --fresh")
        started_broker = True
    took: dict[str, tuple[float, int]] = {}
    began = time.monotonic()
    try:
        for name, command in commands.items():
            print(f"== {name}: {' '.join(command)}", flush=True)
            t0 = time.monotonic()
            with open(out / f"{name}.txt", "wb") as log:
                code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
            took[name] = (time.monotonic() - t0, code)
            print(f"   {took[name][0]:6.1f} s, exit {code} -> {out / (name + '.txt')}", flush=True)
    finally:
        if started_broker:
            _broker("stop")
    total = time.monotonic() - began
    print(f"\n{'benchmark':<18} {'seconds':>8}  exit")
    for name, (seconds, code) in took.items():
        print(f"{name:<18} {seconds:8.1f}  {code}")
    print(f"{'all':<18} {total:8.1f}  (aim: under 600 s together)")
    return 1 if any(code for _, code in took.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
