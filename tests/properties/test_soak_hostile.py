"""Soak: 10,000 hostile records mixed into a real guarded run change nothing.

The demo's real model trains with a loss spike, guarded in lockstep on the
embedded bus with the whole pipeline (four detectors, fusion, the actuator)
and a signing key; the pipeline runs as threads of the trainer's process, or
in its child process (the default: ``worker.embedded_process``). An attacker thread that knows only what it
can read on the bus writes 10,000 hostile records while the run trains:
malformed, huge, far-future, forged and replayed steps, genuine steps of an
earlier session of the run id, steps signed with the trainer key that jump
+500,000 steps or 999 epochs ahead (a detectors host holds that key), forged actions, and
forged verdicts (alone and as a step's record), decisions, checkpoint events
and acks (unsigned, signed with a guessed key, far in the future, for made-up
runs): every topic a consumer reads.

What must hold: the run's decisions and applied actions equal those of the
same run without the attacker; every worker is still running; the pipeline
holds state for the real run only (memory bounded; RSS growth reported);
every hostile step is in the DLQ once per detector, every hostile verdict in
fusion's DLQ and every hostile decision, checkpoint event and ack in the
actuator's, every hostile action is refused (REJECTED ack) or in the DLQ, and
no forged action is applied.

With the child process, only what the trainer publishes crosses to the
pipeline (steps, run events, checkpoint events, acks: ``inputs_of``); verdicts
and decisions written on the trainer's bus reach no worker, so they are in no
DLQ and must change nothing. The child's per-run tables are in another
process: its ``spikeguard_runs_in_memory`` gauges say how many runs each
worker holds, and its RSS is read from /proc.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.demo.run import DEMO_SETTINGS, run_demo
from spikeguard.errors import SchemaError
from spikeguard.metrics import Metrics
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import (
    MAX_COUNTER,
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    DeadLetter,
    Decision,
    StepEvent,
    StepVerdicts,
    Verdict,
    decode,
    encode,
    new_session,
    sign_action,
    sign_step,
    step_signature_problem,
)
from spikeguard.schemas.signing import sign, signature_problem, verify_action
from spikeguard.settings import load_settings

pytestmark = pytest.mark.slow

KEY = "soak-run-key-5f1e0c"
# The session of an earlier run of the same run id: its genuine steps, replayed, must move nothing.
EARLIER_SESSION = new_session(now=1_000_000.0)
HOSTILE = int(os.environ.get("SPIKEGUARD_SOAK_RECORDS", "10000"))
#: The embedded runtime's detectors: the four co-hosted behind one consumer (EMBEDDED_COMPONENTS).
DETECTORS = ("detectors",)


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - not Linux


class Attacker(threading.Thread):
    """Writes HOSTILE records while the run trains, learning the run's id from the bus."""

    def __init__(self, runtime) -> None:
        super().__init__(name="soak-attacker", daemon=True)
        self.bus, self.topics = runtime.bus, runtime.topics
        self.rng = random.Random(7)
        self.steps_sent = 0
        self.actions_sent = 0
        self.to_fusion = 0  # verdicts
        self.decisions_sent = 0
        self.to_actuator = 0  # checkpoint events, acks (what the trainer publishes)
        self.error: BaseException | None = None
        self.read_up_to: dict[int, int] = {}
        self.genuine: list[StepEvent] = []
        self.genuine_at_last_chunk = 0
        self.signatures: set[str] = set()
        self.forged: set[str] = set()  # signatures of its steps signed with the trainer key
        self.jumped_sent = 0  # of those, +500,000 steps or 999 epochs ahead
        self.steps_seen: list[int] = []  # the run's newest step at each chunk

    def run(self) -> None:
        try:
            self._attack()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _victim(self) -> list[StepEvent]:
        """The run's genuine steps so far: the signed ones (the attacker cannot check them)."""
        while True:
            for record in self.bus.read_all(self.topics.steps):
                if record.offset < self.read_up_to.get(record.partition, 0):
                    continue
                self.read_up_to[record.partition] = record.offset + 1
                try:
                    step = decode(record.value, StepEvent)
                except SchemaError:
                    continue
                # Its own forgeries (signed with its guessed key) are not the run's.
                if (
                    step.signature
                    and step.run_id.startswith("demo-")
                    and step_signature_problem(step, "guessed-key") is not None
                    and step.signature not in self.signatures
                    and step.signature not in self.forged  # nor its own, signed with the key
                ):  # nor its replays
                    self.signatures.add(step.signature)
                    self.genuine.append(step)
            # 40 chunks of hostile records, one per three new genuine steps: all through the run
            # (the spike run publishes ~200 steps of its 300: the skipped batches publish none).
            if len(self.genuine) >= max(5, self.genuine_at_last_chunk + 3):
                self.genuine_at_last_chunk = len(self.genuine)
                self.steps_seen.append(self.genuine[-1].step)
                return self.genuine
            threading.Event().wait(0.05)

    def _attack(self) -> None:
        producer, rng, t = self.bus.producer(), self.rng, self.topics
        sent = 0
        while sent < HOSTILE:
            genuine = self._victim()
            run_id, newest = genuine[-1].run_id, genuine[-1]
            for _ in range(HOSTILE // 40):
                kind = (
                    1
                    if sent % 500 == 250
                    else rng.choice([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
                )
                if 9 <= kind <= 12:
                    self._pipeline_record(producer, kind, run_id, newest, sent)
                    sent += 1
                    continue
                if kind == 0:  # malformed bytes
                    value = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
                    producer.publish(t.steps, value, key=run_id)
                elif kind == 1:  # huge: over the 1 MB limit (20 of them)
                    producer.publish(
                        t.steps,
                        b'{"run_id": "%s", "pad": "%s"}' % (run_id.encode(), b"x" * 1_100_000),
                        key=run_id,
                    )
                elif kind == 2:  # far future, beyond the schema's 2**53
                    producer.publish(
                        t.steps,
                        b'{"run_id": "%s", "step": %d, "loss": "NaN"}' % (run_id.encode(), 10**29),
                        key=run_id,
                    )
                elif kind == 3:  # forged NaN steps for the run: unsigned
                    producer.publish(
                        t.steps,
                        encode(
                            StepEvent(
                                run_id=run_id,
                                step=newest.step + 1,
                                epoch=newest.epoch,
                                loss=math.nan,
                                grad_norm=math.nan,
                            )
                        ),
                        key=run_id,
                    )
                elif kind == 4:  # forged with another key, far ahead
                    producer.publish(
                        t.steps,
                        encode(
                            sign_step(
                                StepEvent(
                                    run_id=run_id,
                                    step=newest.step + 10**6,
                                    epoch=newest.epoch,
                                    loss=1e30,
                                ),
                                "guessed-key",
                            )
                        ),
                        key=run_id,
                    )
                elif kind == 5:  # a genuine signed step replayed: backwards
                    producer.publish(t.steps, encode(rng.choice(genuine[:-1])), key=run_id)
                elif kind == 13:  # a genuine step of an earlier session of the run id, replayed
                    earlier = newest.model_copy(
                        update={
                            "session": EARLIER_SESSION,
                            "step": newest.step + 1,
                            "signature": None,
                        }
                    )
                    earlier = sign_step(earlier, KEY)
                    self.forged.add(earlier.signature or "")
                    producer.publish(t.steps, encode(earlier), key=run_id)
                elif kind in (14, 15):  # signed with the trainer key (a detectors host holds it):
                    jump = (  # +500,000 steps, or epoch 999
                        {"step": newest.step + 500_000}
                        if kind == 14
                        else {"epoch": newest.epoch + 999, "step": newest.step + 1}
                    )
                    jumped = newest.model_copy(
                        update={**jump, "time": newest.time + 1.0, "signature": None}
                    )
                    jumped = sign_step(jumped, KEY)
                    self.forged.add(jumped.signature or "")
                    self.jumped_sent += 1
                    producer.publish(t.steps, encode(jumped), key=run_id)
                elif kind == 6:  # forged steps for other runs
                    producer.publish(
                        t.steps,
                        encode(
                            StepEvent(
                                run_id=f"other-{rng.randrange(1000)}",
                                step=rng.randrange(10**6),
                                loss=math.nan,
                            )
                        ),
                        key=f"other-{rng.randrange(1000)}",
                    )
                elif kind == 7:  # forged actions: unsigned stop, or a guessed key
                    forged = Action(
                        action_id=f"forged-{sent}",
                        run_id=run_id,
                        kind=ActionKind.STOP,
                        apply_at_step=newest.step + 1,
                        params={"reason": "forged"},
                    )
                    if rng.random() < 0.5:
                        forged = sign_action(forged, "guessed-key")
                    producer.publish(t.actions, encode(forged), key=run_id)
                    self.actions_sent += 1
                    sent += 1
                    continue
                else:  # an undecodable action
                    producer.publish(t.actions, b'{"action_id": "x", "kind": "stop"', key=run_id)
                    self.actions_sent += 1
                    sent += 1
                    continue
                self.steps_sent += 1
                sent += 1
                if sent >= HOSTILE:
                    break

    def _pipeline_record(
        self, producer, kind: int, run_id: str, newest: StepEvent, sent: int
    ) -> None:
        """A forged record on a topic behind the detectors; half unsigned, half with a guessed key."""
        rng, t = self.rng, self.topics
        guess = (lambda r: r) if rng.random() < 0.5 else (lambda r: sign(r, "guessed-key"))
        if kind == 9:  # a critical verdict for the run's next step, or one for a made-up run
            forged_run = run_id if rng.random() < 0.5 else f"other-{rng.randrange(10**6)}"
            record = Verdict(
                run_id=forged_run,
                step=newest.step + 1,
                epoch=newest.epoch,
                detector="rules",
                is_anomaly=True,
                critical=True,
                type=AnomalyType.NON_FINITE,
                confidence=1.0,
            )
            if rng.random() < 0.5:  # alone, or as a co-hosted detector worker's record of the step
                producer.publish(t.verdicts, encode(guess(record)), key=forged_run)
            else:
                together = StepVerdicts(
                    run_id=forged_run, step=record.step, epoch=record.epoch, verdicts=[record]
                )
                producer.publish(t.step_verdicts, encode(guess(together)), key=forged_run)
            self.to_fusion += 1
            return
        if (
            kind == 10
        ):  # a healthy decision far ahead (it would make every real one late), or a critical one
            step = MAX_COUNTER if rng.random() < 0.5 else newest.step + 1
            record = Decision(
                decision_id=f"forged-d{sent}",
                run_id=run_id,
                step=step,
                epoch=newest.epoch,
                is_anomaly=step != MAX_COUNTER,
                critical=step != MAX_COUNTER,
                type=AnomalyType.NON_FINITE if step != MAX_COUNTER else AnomalyType.NONE,
                confidence=1.0,
                incident_id=f"forged-i{sent}",
                incident_onset_step=step,
            )
            producer.publish(t.decisions, encode(guess(record)), key=run_id)
            self.decisions_sent += 1
            return
        if (
            kind == 11
        ):  # a healthy checkpoint the trainer never wrote: it would be the rollback target
            record = CheckpointEvent(
                run_id=run_id,
                step=newest.step,
                epoch=newest.epoch,
                checkpoint_id=f"forged-c{sent}",
                healthy=True,
            )
            producer.publish(t.checkpoints, encode(guess(record)), key=run_id)
        else:  # an ack saying some action failed
            record = Ack(
                run_id=run_id,
                action_id=f"fake-ack-{sent}",
                kind=ActionKind.ROLLBACK,
                status=AckStatus.FAILED,
                step=newest.step,
            )
            producer.publish(t.acks, encode(guess(record)), key=run_id)
        self.to_actuator += 1


def expected_letters(attacker: Attacker, child: bool) -> dict[str, int]:
    """How many hostile records each consumer must have sent to the DLQ."""
    expected = {detector: attacker.steps_sent for detector in DETECTORS}
    # In the child, the verdicts and decisions written on the trainer's bus reach no worker.
    expected["fusion"] = 0 if child else attacker.to_fusion
    expected["actuator"] = attacker.to_actuator + (0 if child else attacker.decisions_sent)
    return expected


def child_runs_in_memory(child) -> dict[str, float]:
    """Each of the child's workers: how many runs it holds (its spikeguard_runs_in_memory gauge)."""
    return {
        sample.labels["component"]: sample.value
        for family in child.metrics(timeout_s=30)
        for sample in family.samples
        if sample.name == "spikeguard_runs_in_memory"
    }


def guarded_run(attack: bool, workdir, child: bool = False) -> dict:
    """Train the demo's spike run, guarded; what happened, read before the runtime closes."""
    # read() takes every action and ack back from the bus after the run, and the attacker
    # floods the actions topic: keep every consumed record in memory (no retention trim).
    # Threads: the workers' per-run tables are read back below, in this process.
    settings = load_settings(
        {
            **DEMO_SETTINGS,
            "signing_key": KEY,
            "embedded_keep_consumed": 1_000_000,
            "worker.embedded_process": child,
            # Every hostile record in the DLQ, unsigned ones too (by default a flood of them is
            # written up to 1000 per 10 s, then counted).
            "worker.unsigned_letters_per_10s": 1_000_000,
        },
        env={},
    )
    runtime = open_runtime(settings, metrics=Metrics(CollectorRegistry()))
    assert (runtime.child is not None) == child  # not the threads fallback
    pid = runtime.child.process.pid if child else "self"
    attacker = Attacker(runtime) if attack else None
    config = GuardConfig(
        checkpoint_dir=str(workdir),
        checkpoint_every=20,
        keep_checkpoints=4,
        resume=False,
        lockstep=True,
        data_seed=0,
        healthy_stretch=10,
        signing_key=KEY,
        lockstep_settle=1.0,
    )
    try:
        rss_before = rss_bytes(pid)
        if attacker:
            attacker.start()
        outcome = run_demo("spike", seed=0, guarded=True, runtime=runtime, config=config)
        if attacker:
            attacker.join(300)
            assert not attacker.is_alive() and attacker.error is None, attacker.error
            # The workers work through the rest of the hostile backlog (a wait, not a timing test).
            done = threading.Event()
            for _ in range(1200):
                letters = runtime.bus.read_all(runtime.topics.dlq)
                if len(letters) >= sum(expected_letters(attacker, child).values()):
                    break
                done.wait(0.1)
        facts = dict(outcome=outcome, attacker=attacker, rss_growth=rss_bytes(pid) - rss_before)
        if child:
            facts.update(
                alive=[runtime.child.problem is None and runtime.child.process.poll() is None],
                runs_in_memory=child_runs_in_memory(runtime.child),
            )
        else:
            facts.update(
                alive=[t.is_alive() for t in runtime.threads],
                runs={
                    w.stage.name: (
                        set(getattr(w.stage, "runs", {})),
                        set(getattr(w.stage, "_newest", {})),
                    )
                    for w in runtime.workers
                },
            )
        facts.update(read(runtime))
        return facts
    finally:
        runtime.close()


def read(runtime) -> dict:
    t, bus = runtime.topics, runtime.bus

    def events(topic, model):
        out = []
        for record in bus.read_all(topic):
            with contextlib.suppress(SchemaError):
                out.append(decode(record.value, model))
        return out

    # Fusion's own decisions (the attacker writes the topic too) and the trainer's own acks.
    return dict(
        decisions=[d for d in events(t.decisions, Decision) if signature_problem(d, KEY) is None],
        acks=[a for a in events(t.acks, Ack) if signature_problem(a, KEY) is None],
        actions=events(t.actions, Action),
        letters=events(t.dlq, DeadLetter),
        prefix=t.prefix,
        actions_topic=t.actions,
    )


def _decisions(facts) -> list[tuple]:
    return sorted(
        (d.epoch, d.step, d.is_anomaly, d.type.value, d.critical, d.urgency.value)
        for d in facts["decisions"]
    )


def _applied(facts) -> list[tuple]:
    """The applied actions, as decided: kind, due step, parameters.

    Not the step of the ack: lockstep waits for the actions of anomalous
    decisions only, so a restore_lr (decided on a healthy step) may land a
    step later when the machine is busy, with or without an attacker.
    """
    by_id = {a.action_id: a for a in facts["actions"]}
    applied = [by_id[a.action_id] for a in facts["acks"] if a.status is AckStatus.APPLIED]
    # A checkpoint id is a hash of the run id, which differs between the two runs.
    return sorted(
        (
            a.kind.value,
            a.apply_at_step,
            repr(sorted(a.params.model_dump(mode="json", exclude={"checkpoint_id"}).items())),
        )
        for a in applied
    )


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict:
    """The run without an attacker, once: lockstep makes its decisions and actions the same
    whether the pipeline runs in threads or in a child process."""
    return guarded_run(False, tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("pipeline", ["threads", "child process"])
def test_ten_thousand_hostile_records_change_nothing_and_all_land_in_the_dlq(
    tmp_path, pipeline, clean
):
    child = pipeline == "child process"
    hostile = guarded_run(True, tmp_path / "hostile", child)
    attacker = hostile["attacker"]
    print(
        f"soak ({pipeline}): {HOSTILE} hostile records ({attacker.steps_sent} steps, {attacker.actions_sent} "
        f"actions) written from step {attacker.steps_seen[0]} to step {attacker.steps_seen[-1]} "
        f"of the run; RSS growth {hostile['rss_growth'] / 2**20:.1f} MiB "
        f"(the clean run, threads: {clean['rss_growth'] / 2**20:.1f} MiB)"
    )

    # mixed into the run, through the spike (the newest step goes back at the rollback: its max counts)
    assert attacker.steps_seen[0] < 20 and max(attacker.steps_seen) > 100
    # The run's decisions and applied actions are those of the clean run.
    assert clean["outcome"].steps == hostile["outcome"].steps == 300
    assert _decisions(hostile) == _decisions(clean)
    assert _applied(hostile) == _applied(clean) and _applied(clean)
    # Every worker stayed up, holding state for the real run only.
    assert hostile["alive"] and all(hostile["alive"])
    (run_id,) = {d.run_id for d in hostile["decisions"]}
    if child:
        in_memory = hostile["runs_in_memory"]
        assert set(in_memory) == {*DETECTORS, "fusion", "actuator"}, in_memory
        assert all(held <= 1 for held in in_memory.values()), in_memory
    else:
        for name, (runs, newest) in hostile["runs"].items():
            assert runs <= {run_id} and newest <= {run_id}, (name, runs, newest)
    assert hostile["rss_growth"] < 512 * 2**20
    # Nothing lost: every hostile step in the DLQ once per detector ...
    letters = hostile["letters"]
    expected = expected_letters(attacker, child)
    for detector in DETECTORS:
        mine = [d for d in letters if d.consumer == f"{hostile['prefix']}{detector}"]
        assert len(mine) == expected[detector] == attacker.steps_sent, detector
        errors = {d.error for d in mine}
        # (random bytes and a schema-breaking step carry no signature: refused unparsed as such)
        assert errors <= {
            "MalformedMessage",
            "MessageTooLarge",
            "StepNotAuthenticated",
            "StepOutOfOrder",
            "RecordOfOtherSession",
        }, errors
        assert {"StepNotAuthenticated", "StepOutOfOrder", "RecordOfOtherSession"} <= errors
        jumped = [d for d in mine if "than a trainer" in d.reason]
        assert len(jumped) == attacker.jumped_sent, detector
    # ... every hostile verdict in fusion's, every hostile decision, checkpoint and ack in the actuator's
    # (in the child, only what crosses to it: none of the verdicts and decisions) ...
    assert attacker.to_fusion and attacker.decisions_sent and attacker.to_actuator
    for consumer in ("fusion", "actuator"):
        mine = [d for d in letters if d.consumer == f"{hostile['prefix']}{consumer}"]
        assert len(mine) == expected[consumer], consumer
        assert {d.error for d in mine} <= {"RecordNotAuthenticated"}, consumer
    assert not [a for a in hostile["actions"] if (a.decision_id or "").startswith("forged-")]
    # ... every hostile action refused or in the DLQ, and no forged action applied.
    forged_acks = [a for a in hostile["acks"] if a.action_id.startswith("forged-")]
    inbox_letters = [d for d in letters if d.source_topic == hostile["actions_topic"]]
    assert len(forged_acks) + len(inbox_letters) == attacker.actions_sent
    assert forged_acks and all(a.status is AckStatus.REJECTED for a in forged_acks)
    applied = {a.action_id for a in hostile["acks"] if a.status is AckStatus.APPLIED}
    genuine = {a.action_id for a in hostile["actions"] if verify_action(a, KEY)}
    assert applied and applied <= genuine
