"""Where a Guard's steps go and what it signs them with: a runtime handed in, or a bus of one's own.

A runtime (``spikeguard.runtime``) brings its bus, topics and settings, the
signing key among them; a bus handed alone carries no key, so the Guard's
config is its only source of one, and a keyless Guard says so once.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from producers_helpers import Tiny, train

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig
from spikeguard.runtime import Runtime, open_runtime
from spikeguard.schemas import Decision, DeadLetter, StepEvent, Topics, decode
from spikeguard.schemas import step_signature_problem
from spikeguard.settings import Settings, load_settings

STEPS = 12


def _threads_runtime() -> Runtime:
    """The embedded pipeline as threads of this process, under a prefix of its own."""
    prefix = f"gr-{uuid.uuid4().hex[:8]}."
    return open_runtime(
        load_settings({"topic_prefix": prefix, "worker.embedded_process": False}, env={})
    )


def _config(tmp_path, **more) -> GuardConfig:
    return GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, **more)


def _of_run(runtime: Runtime, topic: str, kind, run_id: str) -> list:
    return [
        event
        for event in (decode(r.value, kind) for r in runtime.bus.read_all(topic))
        if getattr(event, "run_id", None) == run_id or getattr(event, "key", None) == run_id
    ]


def test_a_guard_handed_a_runtime_signs_with_its_key_and_the_pipeline_judges_every_step(
    tmp_path,
):
    runtime = _threads_runtime()
    try:
        tiny = Tiny(seed=5)
        guard = Guard(
            tiny.model,
            tiny.optimizer,
            run_id="handed",
            config=_config(tmp_path, lockstep=True),  # each step decided before the next
            runtime=runtime,
        )
        assert not hasattr(runtime.bus, "signing_key")  # the key travels with the runtime only
        train(guard, tiny, STEPS)
        guard.close()
        key = runtime.settings.signing_key
        steps = _of_run(runtime, runtime.topics.steps, StepEvent, "handed")
        assert [s.step for s in steps] == list(range(STEPS))
        assert all(step_signature_problem(s, key) is None for s in steps)
        decided = {d.step for d in _of_run(runtime, runtime.topics.decisions, Decision, "handed")}
        assert decided == set(range(STEPS))  # the pipeline judged every step
        assert _of_run(runtime, runtime.topics.dlq, DeadLetter, "handed") == []
        # The runtime was handed in: its pipeline outlives the Guard.
        assert runtime.threads and all(thread.is_alive() for thread in runtime.threads)
    finally:
        runtime.close()


def test_a_handed_runtime_gives_the_guard_its_bus_topics_and_key_and_stays_open(tmp_path):
    closed: list[str] = []
    bus = EmbeddedBus()
    runtime = Runtime(
        bus,
        Topics("handed."),
        Settings(signing_key="runtime-key-7"),
        closers=[lambda: closed.append("runtime")],
    )
    tiny = Tiny(seed=5)
    guard = Guard(
        tiny.model, tiny.optimizer, run_id="parts", config=_config(tmp_path), runtime=runtime
    )
    assert guard.bus is bus and guard.topics.prefix == "handed."
    train(guard, tiny, 3)
    guard.close()
    assert closed == []  # the caller opened it, the caller closes it
    steps = [decode(r.value, StepEvent) for r in bus.read_all("handed.steps")]
    assert [s.step for s in steps] == [0, 1, 2]
    assert all(step_signature_problem(s, "runtime-key-7") is None for s in steps)


def test_a_keyless_guard_handed_only_a_signed_runtimes_bus_warns_and_its_steps_are_refused(
    tmp_path, caplog, wait_until
):
    runtime = _threads_runtime()
    try:
        tiny = Tiny(seed=5)
        with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
            guard = Guard(
                tiny.model,
                tiny.optimizer,
                run_id="bare",
                config=_config(tmp_path),
                bus=runtime.bus,
                topics=runtime.topics,
            )
        warned = [
            r.getMessage() for r in caplog.records if "without a signing key" in r.getMessage()
        ]
        assert len(warned) == 1 and "runtime=runtime" in warned[0], caplog.text
        train(guard, tiny, STEPS)
        guard.close()

        def refused_steps() -> list[DeadLetter]:
            letters = _of_run(runtime, runtime.topics.dlq, DeadLetter, "bare")
            return [letter for letter in letters if letter.source_topic == runtime.topics.steps]

        refused = wait_until(
            lambda: len(refused_steps()) >= STEPS and refused_steps(),
            "the pipeline refuses the keyless Guard's steps to the DLQ",
        )
        assert all("sign" in letter.reason for letter in refused), refused[0].reason
        assert _of_run(runtime, runtime.topics.decisions, Decision, "bare") == []
    finally:
        runtime.close()


def test_a_guard_with_its_own_key_on_a_bus_of_its_own_does_not_warn(tmp_path, caplog):
    tiny = Tiny(seed=5)
    with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
        guard = Guard(
            tiny.model,
            tiny.optimizer,
            run_id="own-key",
            config=_config(tmp_path, signing_key="own-key-1"),
            bus=EmbeddedBus(),
        )
    guard.close()
    assert "without a signing key" not in caplog.text
    assert guard.signer.key.get_secret_value() == "own-key-1"


@pytest.mark.parametrize("extra", [{"bus": "bus"}, {"topics": "topics"}])
def test_a_runtime_together_with_a_bus_or_topics_is_refused_naming_both(tmp_path, extra):
    bus = EmbeddedBus()
    runtime = Runtime(bus, Topics("handed."), Settings(signing_key="k"))
    given = {name: {"bus": bus, "topics": Topics("other.")}[name] for name in extra}
    tiny = Tiny(seed=5)
    with pytest.raises(TypeError) as refused:
        Guard(
            tiny.model,
            tiny.optimizer,
            run_id="both",
            config=_config(tmp_path),
            runtime=runtime,
            **given,
        )
    message = str(refused.value)
    assert "runtime=" in message and f"{next(iter(extra))}=" in message
