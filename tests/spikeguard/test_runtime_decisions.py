"""The embedded pipeline decides a recorded step stream exactly as the backtest does.

The workers :func:`~spikeguard.runtime.threads.start_workers` starts (the
child process runs the same) are fed a run's signed steps 32 at a time, as
the trainer's publisher hands them off, and every decision is compared,
field by field without its signature, with the offline backtest's on the
same steps. The Kafka workers' layout is held to the backtest in
``tests/processors/test_step_verdicts.py``.
"""

from __future__ import annotations

import json
import time

import pytest

from spikeguard.lab.backtest import backtest_events
from spikeguard.lab.simulate import generate
from spikeguard.runtime.threads import embedded_runtime, start_workers
from spikeguard.schemas import Decision, sign_step
from spikeguard.settings import load_settings

KEY = "runtime-decisions-key-0123456789abcdef"
HANDOFF = 32  # steps per hand-off of the trainer's publisher


def _unsigned(decisions) -> dict[tuple[str, int], str]:
    return {
        (d.run_id, d.step): json.dumps(
            d.model_dump(mode="json", exclude={"signature", "decision_id"}), sort_keys=True
        )
        for d in decisions
    }


@pytest.mark.heavy
@pytest.mark.parametrize("scenario, seed", [("sudden_spike", 1), ("non_finite", 2)])
def test_the_embedded_workers_decide_a_recorded_stream_as_the_backtest(scenario, seed):
    events = generate(scenario, 400, seed, run_id=f"rec-{scenario}").events
    settings = load_settings({"topic_prefix": "recdec.", "signing_key": KEY}, env={})
    runtime = embedded_runtime(settings, settings)
    bus, topics = runtime.connected_bus(), runtime.topics
    decided = bus.consumer("test-decided", [topics.decisions])
    start_workers(runtime)
    live: list[Decision] = []
    try:
        producer = bus.producer()
        for start in range(0, len(events), HANDOFF):
            batch = events[start : start + HANDOFF]
            producer.publish_records(
                [(topics.steps, e.run_id.encode(), None, (), sign_step(e, KEY)) for e in batch]
            )
            producer.flush()
        deadline = time.monotonic() + 60
        while len(live) < len(events) and time.monotonic() < deadline:
            live += [r.decoded(Decision) for r in decided.poll(10_000, 0.05)]
    finally:
        decided.close()
        runtime.close()
    offline = backtest_events(events)
    assert len(live) == len(events)
    assert _unsigned(live) == _unsigned(offline)
    assert any(d.is_anomaly for d in offline)
