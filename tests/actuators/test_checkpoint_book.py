"""The rollback target is chosen only among checkpoints the trainer still has."""

from spikeguard.actuators.checkpoints import CheckpointBook
from spikeguard.schemas import CheckpointEvent


def event(step, healthy=True, deleted=False):
    return CheckpointEvent(
        run_id="r", step=step, checkpoint_id=f"c{step}", healthy=healthy, deleted=deleted
    )


def test_a_deleted_checkpoint_is_no_longer_a_target():
    book = CheckpointBook(capacity=8)
    for step in (20, 40, 60, 80, 100, 120):
        book.add(event(step))
    assert book.target(onset_step=150, min_steps_before=100).step == 40
    book.add(event(40, deleted=True))
    assert book.target(onset_step=150, min_steps_before=100).step == 20
    book.add(event(20, deleted=True))
    assert book.target(onset_step=150, min_steps_before=100) is None
    assert book.target(onset_step=150, min_steps_before=20).step == 120


def test_an_unhealthy_checkpoint_never_pushes_out_a_healthy_one():
    book = CheckpointBook(capacity=2)
    book.add(event(10))
    for step in range(20, 200, 10):
        book.add(event(step, healthy=False))
    assert book.target(onset_step=500, min_steps_before=0).step == 10
