"""The background publisher: never blocks training, drops the oldest, counts what it dropped."""

from __future__ import annotations

import threading
import time

from spikeguard.bus import EmbeddedBus
from spikeguard.bus.embedded import EmbeddedProducer
from spikeguard.producers import BackgroundPublisher
from spikeguard.schemas import Ack, AckStatus, ActionKind, StepEvent, Topics, decode


def _step(i):
    return dict(run_id="p", step=i, loss=1.0)


def test_never_blocks_and_drops_the_oldest_when_the_bus_is_away(gated_producer):
    bus, t = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    pub = BackgroundPublisher(producer, "p", queue_size=10, interval=0.001)
    pub.submit(t.steps, StepEvent, _step(0))
    assert producer.waiting.wait(10)  # the sender thread now hangs on the first record
    started = time.perf_counter()
    for i in range(1, 100):
        pub.submit(t.steps, StepEvent, _step(i))
    per_call = (time.perf_counter() - started) / 99
    assert per_call < 1e-3
    assert pub.dropped == 89  # 99 queued into 10 places
    producer.gate.set()
    assert pub.flush(5.0)
    pub.close()
    steps = [decode(r.value, StepEvent).step for r in bus.read_all(t.steps)]
    assert steps == [0] + list(range(90, 100))  # the newest survive
    assert pub.sent == 11 and pub.failed == 0


def test_acks_are_not_dropped_by_a_flood_of_steps_and_go_first(gated_producer):
    bus, t = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    pub = BackgroundPublisher(producer, "p", queue_size=5, interval=0.001)
    for i in range(50):
        pub.submit(t.steps, StepEvent, _step(i))
    pub.submit(
        t.acks,
        Ack,
        dict(run_id="p", action_id="a-1", kind=ActionKind.CLIP, status=AckStatus.APPLIED, step=3),
        droppable=False,
    )
    producer.gate.set()
    pub.close()
    assert [decode(r.value, Ack).action_id for r in bus.read_all(t.acks)] == ["a-1"]
    assert len(bus.read_all(t.steps)) <= 6


def test_a_failing_bus_is_counted_not_raised():
    class Broken:
        def publish(self, *a, **k):
            raise ConnectionError("broker away")

        def flush(self, timeout=None):
            pass

    pub = BackgroundPublisher(Broken(), "p", threaded=False)
    pub.submit(Topics().steps, StepEvent, _step(0))
    assert pub.failed == 1 and pub.sent == 0


def test_a_guard_with_a_key_signs_every_step_it_publishes(tmp_path):
    # A real Guard and model: the steps it publishes verify under its key, and only under it.
    import math

    from spikeguard.schemas import step_signature_problem
    from producers_helpers import Tiny, make_guard, train

    for key in ("guard-key-42", None):
        bus = EmbeddedBus()
        tiny = Tiny(seed=3)
        guard = make_guard(tiny, bus, tmp_path / str(key), signing_key=key)
        train(guard, tiny, 12)
        guard.close()
        steps = [decode(r.value, StepEvent) for r in bus.read_all(Topics().steps)]
        assert [s.step for s in steps] == list(range(12))
        assert all(math.isfinite(s.loss) for s in steps)
        if key is None:
            assert all(s.signature is None for s in steps)
        else:
            assert all(step_signature_problem(s, key) is None for s in steps)
            assert all(step_signature_problem(s, "another-key") is not None for s in steps)


def test_a_guard_handed_the_default_runtime_signs_with_that_runtimes_key(tmp_path, wait_until):
    # The default embedded runtime runs its pipeline in a child process, which takes the
    # trainer's step fields unsigned and signs them itself only when the Guard's key is its own.
    from spikeguard.producers import Guard, GuardConfig
    from spikeguard.runtime import open_runtime
    from spikeguard.schemas import DeadLetter, Decision, step_signature_problem
    from spikeguard.settings import load_settings
    from producers_helpers import Tiny, train

    with open_runtime(load_settings({}, env={})) as runtime:
        assert runtime.child is not None
        tiny = Tiny(seed=3)
        guard = Guard(
            tiny.model,
            tiny.optimizer,
            run_id="r1",
            config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False),
            runtime=runtime,
        )
        train(guard, tiny, 12)
        guard.close()
        key = runtime.settings.signing_key
        steps = [decode(r.value, StepEvent) for r in runtime.bus.read_all(runtime.topics.steps)]
        assert [s.step for s in steps] == list(range(12))
        assert all(step_signature_problem(s, key) is None for s in steps)
        # The pipeline judged the steps (the newest wait for the run's end, published at close).
        wait_until(
            lambda: runtime.bus.read_all(runtime.topics.decisions),
            "a decision on the guarded run",
        )
        decisions = [
            decode(r.value, Decision) for r in runtime.bus.read_all(runtime.topics.decisions)
        ]
        assert {d.run_id for d in decisions} == {"r1"}
        refused = [decode(r.value, DeadLetter) for r in runtime.bus.read_all(runtime.topics.dlq)]
        assert refused == []


def test_a_flood_of_ordinary_steps_never_pushes_an_urgent_step_out(gated_producer):
    # Under backlog the queue drops the oldest *ordinary* step: a non-finite or skipped step
    # is what the pipeline exists for, and a drop-oldest queue used to lose it first.
    bus, t = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    pub = BackgroundPublisher(producer, "p", queue_size=10, interval=0.001)
    for i in range(100):
        pub.submit(t.steps, StepEvent, _step(i), urgent=i in (3, 50))
    producer.gate.set()
    assert pub.flush(5.0)
    pub.close()
    steps = [decode(r.value, StepEvent).step for r in bus.read_all(t.steps)]
    assert 3 in steps and 50 in steps
    assert steps == sorted(steps)  # kept in order
    assert len(steps) + pub.dropped == 100 and len(steps) <= 11


def test_an_urgent_step_is_sent_at_once_not_at_the_next_interval():
    bus, t = EmbeddedBus(), Topics()
    pub = BackgroundPublisher(bus.producer(), "p", interval=60.0)  # ordinary steps: once a minute
    try:
        pub.submit(t.steps, StepEvent, _step(0), urgent=True)
        sent = threading.Event()
        for _ in range(500):  # a bound on polling, not a timing assertion
            if bus.read_all(t.steps):
                sent.set()
                break
            threading.Event().wait(0.01)
        assert sent.is_set(), "the urgent step waited for the sender's interval"
    finally:
        pub.close()


def test_a_guard_under_backlog_still_publishes_its_non_finite_step(tmp_path, gated_producer):
    # A real Guard and model, its bus away for 40 steps with room for 5: the step whose loss is
    # NaN (the one thing the pipeline must see) is among those that reach the bus.
    import math

    from producers_helpers import Tiny, make_guard

    class AwayBus(EmbeddedBus):
        gate = threading.Event()

        def producer(self):
            return gated_producer(self, self.gate, inner=EmbeddedProducer(self))

    bus = AwayBus()
    tiny = Tiny(seed=1)
    guard = make_guard(tiny, bus, tmp_path, queue_size=5, checkpoint_every=0)
    batch = next(iter(tiny.loader))
    for i in range(40):
        loss = tiny.loss(batch)
        guard.step(loss * float("nan") if i == 7 else loss)
    bus.gate.set()
    guard.close()
    steps = {s.step: s for s in (decode(r.value, StepEvent) for r in bus.read_all(Topics().steps))}
    assert 7 in steps and math.isnan(steps[7].loss) and steps[7].skip_reason == "non_finite"
    assert guard.publisher.dropped > 0  # the backlog was real


def _raw_step(i):
    return _step(i)  # what RunEvents.step_fields makes, from the values handed over


def test_steps_handed_over_raw_keep_their_order_with_urgent_ones_and_flush_waits_for_them(
    gated_producer,
):
    # submit_step appends without the lock; an urgent step submitted after them must still go
    # after them, and flush must wait for them too.
    bus, t = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    pub = BackgroundPublisher(producer, "p", queue_size=1000, interval=0.001)
    pub.submit(t.steps, StepEvent, _step(0))
    assert producer.waiting.wait(10)  # the sender hangs on step 0: the rest queue up
    for i in range(1, 60):
        if i in (20, 41):
            pub.submit(t.steps, StepEvent, _step(i), urgent=True)
        else:
            pub.submit_step(t.steps, _raw_step, (i,))
    producer.gate.set()
    assert pub.flush(5.0)
    steps = [decode(r.value, StepEvent).step for r in bus.read_all(t.steps)]
    assert steps == list(range(60)) and pub.sent == 60
    pub.close()


def test_a_raw_step_handed_to_a_parked_sender_goes_out_without_another_submit():
    # The sender sleeps until woken once a round found nothing: a trainer that stops after a
    # burst (an evaluation) must not leave its last steps unsent until it steps again.
    bus, t = EmbeddedBus(), Topics()
    pub = BackgroundPublisher(bus.producer(), "p", interval=0.001)
    try:
        for burst in range(3):
            for _ in range(200):  # a bound on polling, not a timing assertion
                if pub._parked:
                    break
                threading.Event().wait(0.01)
            assert pub._parked
            pub.submit_step(t.steps, _raw_step, (burst,))
            for _ in range(500):
                if len(bus.read_all(t.steps)) == burst + 1:
                    break
                threading.Event().wait(0.01)
            assert len(bus.read_all(t.steps)) == burst + 1, "the step waited for another submit"
    finally:
        pub.close()


def test_a_flood_of_raw_steps_is_bounded_and_counted(gated_producer):
    bus, t = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    pub = BackgroundPublisher(producer, "p", queue_size=10, interval=0.001)
    pub.submit(t.steps, StepEvent, _step(0))
    assert producer.waiting.wait(10)
    for i in range(1, 100):
        pub.submit_step(t.steps, _raw_step, (i,))
        assert len(pub._raw) + len(pub._steps) <= 21
    producer.gate.set()
    assert pub.flush(5.0)
    pub.close()
    steps = [decode(r.value, StepEvent).step for r in bus.read_all(t.steps)]
    assert steps == sorted(steps) and steps[-1] == 99
    assert len(steps) + pub.dropped == 100
