"""What the Kafka benchmarks share: a broker, the six workers of docs/kafka.md, signed step events.

- :func:`broker`: the one given (``--bootstrap`` / ``SPIKEGUARD_TEST_BOOTSTRAP``),
  else a local one started with ``scripts/kafka_local.sh`` and stopped after.
- :func:`workers`: ``spikeguard worker NAME`` for the six components, as
  docs/kafka.md starts them, each its own process, under a fresh topic prefix so
  that runs never see each other's records; waits until every group has a member.
  :data:`LAYOUTS` names the two ways to run them: ``independent`` (six
  processes, the default in docs/design.md) and ``cohosted`` (``worker detectors``
  hosting the four detectors behind one consumer, then fusion and actuator:
  three processes).
- :func:`signed_steps`: simulated runs' step events, signed as a trainer's Guard
  signs them (the pipeline refuses unsigned steps).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator, cast

from spikeguard.bus.kafka import KafkaBus
from spikeguard.components import COMPONENTS
from spikeguard.schemas import StepEvent, Topics, sign_step

ROOT = Path(__file__).resolve().parent.parent

#: Layout -> the `spikeguard worker NAME` processes it runs.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "independent": COMPONENTS,
    "cohosted": ("detectors", "fusion", "actuator"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def broker(bootstrap: str | None) -> Iterator[str]:
    """A broker address: ``bootstrap`` as given, else a local broker for the duration."""
    if bootstrap:
        yield bootstrap
        return
    port = _free_port()
    env = {
        **os.environ,
        "SPIKEGUARD_KAFKA_PORT": str(port),
        "SPIKEGUARD_KAFKA_CONTROLLER_PORT": str(port + 1),
        "SPIKEGUARD_PYTHON": sys.executable,
    }
    script = str(ROOT / "scripts" / "kafka_local.sh")
    subprocess.run(["bash", script, "start", "--fresh"], env=env, check=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", script, "stop"], env=env, check=False)


@contextlib.contextmanager
def workers(
    bootstrap: str,
    prefix: str,
    key: str,
    extra_env: dict[str, str] | None = None,
    names: tuple[str, ...] = COMPONENTS,
    timeout: float = 90.0,
    client: str = "kafka-python",
    cprofile: str | None = None,
    stage_clock: str | None = None,
) -> Iterator[list[subprocess.Popen]]:
    """The workers of docs/kafka.md under ``prefix``, one process each; stopped (SIGTERM) on exit.

    ``client`` is their ``kafka_client`` (``kafka-python`` or ``confluent``). ``cprofile``: a
    directory where each worker's loop is profiled (``cprofile_spikeguard.py``) into ``NAME.STAGE.prof``;
    ``stage_clock``: one where its stage timers go instead, into ``NAME.STAGE.json``.
    """
    env = {
        **os.environ,
        "SPIKEGUARD_TOPIC_PREFIX": prefix,
        "SPIKEGUARD_SIGNING_KEY": key,
        "SPIKEGUARD_BOOTSTRAP_SERVERS": bootstrap,
        "SPIKEGUARD_KAFKA_CLIENT": client,
        **(extra_env or {}),
    }
    # Logs to files, not pipes: a pipe nobody reads fills up and blocks the worker that logs.
    logs = Path(tempfile.mkdtemp(prefix="spikeguard-bench-workers-"))
    launch = [sys.executable, "-m", "spikeguard"]
    for directory, flags in (
        (cprofile, ["{directory}/{name}.prof"]),
        (stage_clock, ["--stages", "{directory}/{name}.json"]),
    ):
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            launch = [
                sys.executable,
                str(ROOT / "benchmarks" / "cprofile_spikeguard.py"),
                *(f.replace("{directory}", directory) for f in flags),
            ]
    procs = [
        subprocess.Popen(
            [*(a.format(name=name) for a in launch), "worker", name],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(logs / f"{name}.log", "w"),  # noqa: SIM115 - the worker process holds it
        )
        for name in names
    ]
    try:
        bus = KafkaBus(bootstrap)
        groups = [f"{prefix}{name}" for name in names]
        deadline = time.monotonic() + timeout
        while True:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                name = worker_name(dead[0])
                raise RuntimeError(
                    f"worker {name} exited at start: {(logs / f'{name}.log').read_text()[-2000:]}"
                )
            if set(groups) <= bus.active_groups(groups):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not all in their groups after {timeout}s")
            time.sleep(0.5)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def worker_name(proc: subprocess.Popen) -> str:
    """The component a process of :func:`workers` runs: the last word of its command line."""
    return cast("list[str]", proc.args)[-1]  # workers() starts each from a list of str


def new_prefix() -> str:
    return f"bench-{uuid.uuid4().hex[:8]}."


def new_key() -> str:
    return secrets.token_hex(32)


def signed_steps(
    runs: int, steps: int, key: str, scenario: str = "stable", seed: int = 0
) -> list[list[StepEvent]]:
    """``runs`` simulated runs of ``steps`` steps each, every event signed with ``key``."""
    from spikeguard.lab.simulate import generate

    out = []
    for r in range(runs):
        events = generate(scenario, max(200, steps), seed + r, run_id=f"bench-run-{r:04d}").events[
            :steps
        ]
        out.append([sign_step(e, key) for e in events])
    return out


def topics(prefix: str) -> Topics:
    return Topics(prefix)
