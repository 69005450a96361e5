"""A Guard's session: in every record it publishes, new at every start, and a resume says its
rollback targets again under the new session (the pipeline starts a new session afresh)."""

from __future__ import annotations

import pytest
from producers_helpers import Tiny, make_guard, train

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import CheckpointEvent, RunEvent, StepEvent, Topics, decode


def records(bus, topic, model):
    return [decode(r.value, model) for r in bus.read_all(topic)]


@pytest.mark.heavy  # ~5 s: two Guards train
def test_every_record_names_the_session_and_a_resume_announces_its_checkpoints_anew(tmp_path):
    topics, bus = Topics(), EmbeddedBus()
    first = make_guard(Tiny(), bus, tmp_path, checkpoint_every=4, async_checkpoint=False)
    train(first, Tiny(), 10)
    first.close(finished=False)
    tiny = Tiny(seed=1)
    resumed = make_guard(tiny, bus, tmp_path, checkpoint_every=4, resume="auto")
    train(resumed, tiny, 12)
    resumed.close(finished=False)

    assert first.session != resumed.session and resumed.session > first.session
    steps = records(bus, topics.steps, StepEvent)
    assert {s.session for s in steps if s.step < 10 and s.time <= steps[9].time} == {first.session}
    assert {s.session for s in steps[10:]} == {resumed.session}
    (latest,) = records(bus, topics.runs, RunEvent)  # (compacted: the resumed session's end)
    assert latest.kind == "end" and latest.session == resumed.session
    on_disk = {(c.step, c.checkpoint_id) for c in first.store.list()}
    announced = {
        (c.step, c.checkpoint_id)
        for c in records(bus, topics.checkpoints, CheckpointEvent)
        if c.session == resumed.session
    }
    assert on_disk and on_disk <= announced  # the resumed session's own rollback targets
