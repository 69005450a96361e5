"""An outage never changes a decision: a run fed through a 30 s broker outage across its spike
gets the decisions and actions of the same run without one.

The broker is the test's own (``scripts/kafka_local.sh`` on a free port pair, its own data
directory), never the shared test broker: it is stopped for ``OUTAGE_S`` right after the
spike's steps were published, while a trainer-like feed goes on publishing into its
producer's buffer, then started again on the same data. The run without the outage is the
offline pipeline (``replay_events``): the same stages, deterministic, and what a live run
without an outage decides (the scale-out and replay tests hold that).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spikeguard.lab.backtest import replay_events
from spikeguard.schemas import (
    Action,
    CheckpointEvent,
    Decision,
    StepEvent,
    Topics,
    Verdict,
    decode,
    encode,
)
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings

from .test_kafka_local import free_port_pair, script

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
RUN = "outage-run"
KEY = "outage-test-key-" + "5" * 16
STEPS = 200  # the tail after the spike is paced (below): 50 steps are enough to see it decided
SPIKE = 150  # targets x40 for 8 steps: the rules' critical extreme_loss, a rollback to c50
CHECKPOINT_EVERY = 50
STEPS_PER_SECOND = 5  # from just before the spike on (the history before it goes at once)
OUTAGE_S = 30.0


def loss(step: int) -> float:
    healthy = 3.0 * (step + 10) ** -0.3 * (1 + 0.01 * math.sin(step * 1.7))
    return healthy * 40 if SPIKE <= step < SPIKE + 8 else healthy


def the_run() -> tuple[list[StepEvent], list[CheckpointEvent]]:
    steps = [
        StepEvent(run_id=RUN, step=s, loss=loss(s), grad_norm=1.0 + 0.05 * math.cos(s * 0.7))
        for s in range(STEPS)
    ]
    checkpoints = [
        CheckpointEvent(run_id=RUN, step=s, checkpoint_id=f"c{s}", healthy=True)
        for s in range(CHECKPOINT_EVERY, SPIKE, CHECKPOINT_EVERY)
    ]
    return steps, checkpoints


def anomalous(decisions) -> dict[int, tuple]:
    """What each anomalous decision says. A critical verdict decides its step alone, so which
    other verdicts had arrived by then (``missing``) is timing; any other step waits for all.
    A step decided again (a restarted worker) must be decided the same way."""
    said: dict[int, set] = {}
    for d in decisions:
        said.setdefault(d.step, set()).add(
            (
                d.type.value,
                d.critical,
                d.urgency.value if d.urgency else None,
                None if d.critical else tuple(sorted(d.missing)),
            )
            if d.is_anomaly
            else None
        )
    assert all(len(ways) == 1 for ways in said.values()), {
        s: w for s, w in said.items() if len(w) > 1
    }
    return {step: next(iter(ways)) for step, ways in said.items() if None not in ways}


def summary(actions) -> list[tuple]:
    """The actions, by id (a hash of what they derive from), kind, step and parameters; the live
    actuator's pulses ("judged up to step s": wall-clock paced) are not decisions' actions.
    Each once: a restarted worker publishes again what it had not committed (the same id,
    which a trainer applies once)."""
    return sorted(
        {
            (a.action_id, a.kind.value, a.apply_at_step, repr(a.params))
            for a in actions
            if a.kind.value != "pulse"
        }
    )


class Supervised:
    """``spikeguard worker all``, restarted when it exits on an error, as the deployment's
    ``restart: unless-stopped`` does: a worker whose outputs the broker has not acknowledged
    within the producer's delivery timeout (120 s; on a loaded machine the broker's own
    restart makes the 30 s outage last that long) stops before it saves anything past them,
    and its restart redoes those batches from its snapshot."""

    MAX_RESTARTS = 3

    def __init__(self, env: dict, log: Path) -> None:
        self.env, self.log = env, log
        self.restarts = 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "spikeguard", "worker", "all"],
            env=self.env,
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT,
            text=True,
        )

    def check(self) -> None:
        """Fails the test if the worker stopped other than on an error, or too often."""
        code = self.process.poll()
        if code is None:
            return
        tail = self.log.read_text()[-3000:]
        assert code != 0 and "cannot go on" in tail and self.restarts < self.MAX_RESTARTS, tail
        self.restarts += 1
        print(
            f"worker exited ({code}) after the outage: restarted ({self.restarts})\n{tail[-600:]}"
        )
        self.process = self._start()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Feed(threading.Thread):
    """Publishes the run's signed steps (and checkpoints after the step they follow) at a steady
    rate, as a trainer does (the history well before the spike at once), whether the broker is
    there or not; ``published`` is the newest step."""

    def __init__(self, bus, topics: Topics, steps, checkpoints) -> None:
        super().__init__(daemon=True)
        self.bus, self.topics = bus, topics
        self.steps = steps
        self.checkpoints = {c.step: c for c in checkpoints}
        self.published = -1
        self.error: BaseException | None = None

    def run(self) -> None:
        from spikeguard.errors import DeliveryError

        try:
            producer = self.bus.producer()
            for event in self.steps:
                while (
                    True
                ):  # as a trainer's publisher does: a record the broker refused is sent again
                    producer.publish(self.topics.steps, encode(sign(event, KEY)), key=RUN)
                    if event.step in self.checkpoints:
                        producer.publish(
                            self.topics.checkpoints,
                            encode(sign(self.checkpoints[event.step], KEY)),
                            key=RUN,
                        )
                    try:
                        # Waits in the producer while the broker is away (no duplicate from a
                        # timeout); refused at once when the client knows no leader: sent again.
                        producer.flush(180)
                        break
                    except DeliveryError:
                        time.sleep(0.5)
                self.published = event.step
                if event.step >= SPIKE - 10:
                    time.sleep(1 / STEPS_PER_SECOND)
            producer.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def read(bus, topic: str, model) -> list:
    return [
        e
        for e in (decode(r.value, model) for r in bus.read_all(topic, timeout=30))
        if e.run_id == RUN
    ]


def comeback(bus, topics: Topics, back_at: float) -> str:
    """When each detector published again after the broker came back (wall seconds after it):
    how far apart they rejoined, against fusion's deadline_seconds."""
    first: dict[str, float] = {}
    for record in bus.read_all(topics.verdicts, timeout=30):
        at = record.timestamp_ms / 1000 - back_at
        if at >= 0:
            name = decode(record.value, Verdict).detector
            first[name] = min(first.get(name, at), at)
    return ", ".join(
        f"{name} +{at:.1f}s" for name, at in sorted(first.items(), key=lambda item: item[1])
    )


def test_a_30s_broker_outage_across_the_spike_changes_no_decision_and_no_rollback(tmp_path):
    from spikeguard.bus.kafka import KafkaBus

    steps, checkpoints = the_run()
    reference = replay_events(steps, checkpoints, load_settings({}, env={}))
    prefix = "spikeguard."
    topics = Topics(prefix)
    want_decisions = anomalous(reference[topics.decisions])
    want_actions = summary(reference[topics.actions])
    assert want_decisions[SPIKE][:2] == (
        "extreme_loss",
        True,
    )  # the run is the incident it means to be
    assert any(a.kind.value == "rollback" for a in reference[topics.actions])

    port = free_port_pair()
    bootstrap = f"127.0.0.1:{port}"
    log = tmp_path / "pipeline.log"
    worker = None
    try:
        started = script(port, "start", "--fresh")
        assert started.returncode == 0, started.stderr
        bus = KafkaBus(bootstrap)
        bus.create_topics(topics.all())
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
        env.update(SPIKEGUARD_BOOTSTRAP_SERVERS=bootstrap, SPIKEGUARD_SIGNING_KEY=KEY)
        worker = Supervised(env, log)
        deadline = time.monotonic() + 120
        while "spikeguard worker:" not in log.read_text():
            assert worker.process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

        feed = Feed(bus, topics, steps, checkpoints)
        feed.start()
        while feed.published < SPIKE + 2:  # the spike's first steps are on the broker, being judged
            assert feed.error is None and feed.is_alive(), feed.error
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
        down = time.monotonic()
        stopped = script(port, "stop")
        assert stopped.returncode == 0, stopped.stderr
        print(f"\nbroker stopped at step {feed.published} in {time.monotonic() - down:.1f}s")
        outage_left = max(0.0, OUTAGE_S - (time.monotonic() - down))
        time.sleep(outage_left)  # the outage itself, not a wait on a condition
        restarted = script(port, "start")
        assert restarted.returncode == 0, restarted.stderr
        back_at = time.time()
        print(
            f"broker back after {time.monotonic() - down:.1f}s; the feed is at step {feed.published}"
        )

        deadline = time.monotonic() + 120
        decided: set[int] = set()
        while len(decided) < STEPS:
            worker.check()
            assert feed.error is None, feed.error
            assert time.monotonic() < deadline, (
                f"{STEPS - len(decided)} steps undecided\n" + log.read_text()[-3000:]
            )
            decided = {d.step for d in read(bus, topics.decisions, Decision)}
            time.sleep(0.5)
        feed.join(60)
        print(f"verdicts again after the broker came back: {comeback(bus, topics, back_at)}")
        got = read(bus, topics.decisions, Decision)
        without = sorted({d.step for d in got if d.missing and not d.critical})
        print(f"steps decided without a detector's verdict: {len(without)} {without[:12]}")
        assert len(got) >= STEPS
        assert anomalous(got) == want_decisions
        deadline = time.monotonic() + 30
        while (
            summary(read(bus, topics.actions, Action)) != want_actions
            and time.monotonic() < deadline
        ):
            worker.check()
            time.sleep(0.5)  # the actuator answers the last decisions
        assert summary(read(bus, topics.actions, Action)) == want_actions
        bus.close()
    finally:
        if worker is not None:
            worker.stop()
        script(port, "stop")
        cache = Path(os.environ.get("SPIKEGUARD_CACHE", Path.home() / ".cache" / "spikeguard"))
        shutil.rmtree(cache / "kafka" / f"run-{port}", ignore_errors=True)
