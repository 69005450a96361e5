"""Lateness never costs recoverability (issue 37, row 4).

The finding: with the broker away for 60 s and a spike inside the outage, the decision came
late and right, but the checkpoints before its onset had rotated out meanwhile: no rollback,
then STOP. Here the pipeline's pulses (signed ``pulse`` actions, how the trainer learns how far
its steps are judged) stop at step 50 while the run trains on to step 150, with
``keep_checkpoints=4``: the checkpoint a late decision needs (at least the policy's distance
before the oldest step not judged) is still on disk, no deletion of it is published, and a
rollback to it, as the late action asks, lands there. Here on the embedded bus; the same
scenario on the real broker is tests/integration/test_late_decisions_kafka.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig
from spikeguard.producers.checkpoints import Awaiting, CheckpointStore
from spikeguard.schemas import Action, ActionKind, CheckpointEvent, Topics, decode, encode
from spikeguard.schemas.signing import sign_action

KEY = "late-decisions-test-key-" + "7" * 16
EVERY, KEEP, DISTANCE = 10, 4, 10  # the policy's rollback_min_steps_before_onset: DISTANCE
JUDGED = 50  # the newest step a pulse names; none after it (the outage)


RUN = "late-run"


def _pulse(run_id: str, step: int) -> bytes:
    action = Action(
        action_id=f"pulse-{step}",
        run_id=run_id,
        kind=ActionKind.PULSE,
        apply_at_step=step,
        params={"judged_step": step, "epoch": 0},
    )
    return encode(sign_action(action, KEY))


def _guard(tmp_path, bus, topics: Topics) -> tuple[Guard, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GuardConfig(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=EVERY,
        keep_checkpoints=KEEP,
        detection_delay_steps=EVERY * (KEEP - 1) - DISTANCE,
        async_checkpoint=False,
        resume=False,
        signing_key=KEY,
        policy={"rollback_min_steps_before_onset": DISTANCE},
    )
    return Guard(model, opt, run_id=RUN, bus=bus, topics=topics, config=config), model, opt


def _train(guard: Guard, model, opt, until: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    while guard.step_count < until:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss.detach())


def late_decision(tmp_path, bus, topics: Topics) -> None:
    """The scenario on ``bus``: pulses up to step 50, then none; a rollback to before 41 at 150."""
    guard, model, opt = _guard(tmp_path, bus, topics)
    _train(guard, model, opt, JUDGED + 1)
    producer = bus.producer()
    producer.publish(topics.actions, _pulse(RUN, JUDGED), key=RUN)
    producer.flush()
    deadline = time.monotonic() + 30.0
    while guard.inbox.protection.judged != (0, JUDGED):  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the pulse never reached the trainer"
        time.sleep(0.005)
    _train(guard, model, opt, 150)  # nothing judged after step 50: the pipeline is away
    guard.publisher.flush(5.0)  # type: ignore[union-attr]

    needed = JUDGED + 1 - DISTANCE  # a decision for step 51 on needs a target at or before 41
    kept = sorted(c.step for c in guard.store.list(0))
    assert 40 in kept, kept
    assert len(kept) <= KEEP + 2, kept  # the newest KEEP, the newest healthy, the awaited one
    deleted = {
        e.step
        for e in (decode(r.value, CheckpointEvent) for r in bus.read_all(topics.checkpoints))
        if e.deleted and e.run_id == RUN
    }
    assert 40 not in deleted and {10, 20, 30} <= deleted, sorted(deleted)
    text = guard.rollback(needed, None, onset_step=JUDGED + 20)  # what the late action asks
    assert text.startswith("rolled back to step 40"), text
    guard.close(finished=False)


@pytest.mark.heavy  # (150 guarded steps with 15 checkpoints: ~5 s on a loaded box)
def test_a_decision_that_comes_late_still_finds_its_checkpoint(tmp_path):
    late_decision(tmp_path, EmbeddedBus(), Topics())


def test_rotation_keeps_the_newest_healthy_checkpoint_far_enough_before_what_is_not_judged(
    tmp_path,
):
    store = CheckpointStore(tmp_path, "r", keep=2)
    store.awaiting = Awaiting(epoch=0, max_step=35)
    for step in range(0, 100, 10):
        store.save({"x": torch.zeros(1)}, step=step, epoch=0, healthy=step != 30)
    assert [c.step for c in store.list()] == [90, 80, 20]  # 30 is not healthy: 20 is awaited
    store.awaiting = Awaiting(epoch=0, max_step=-1)  # nothing judged yet: the oldest healthy
    store.save({"x": torch.zeros(1)}, step=100, epoch=0, healthy=True)
    assert [c.step for c in store.list()] == [100, 90, 20]
    store.awaiting = None  # nobody judges this run: the newest KEEP and the newest healthy only
    store.save({"x": torch.zeros(1)}, step=110, epoch=0, healthy=True)
    assert [c.step for c in store.list()] == [110, 100]
