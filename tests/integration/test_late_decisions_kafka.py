"""On a real broker: lateness never costs recoverability (issue 37, row 4).

The Guard on Kafka reads the pipeline's pulses from the actions topic; they stop at step 50
(the pipeline is away: an outage, a flood, restarted workers) while the run trains on to
step 150 with ``keep_checkpoints=4``. The checkpoint a late decision needs is still on disk,
no deletion of it is published on the checkpoints topic, and a rollback to it lands there
(the scenario: tests/producers/test_late_decisions.py). The shared broker is never stopped:
the pipeline's silence is the absence of pulses, which is what the trainer sees of an outage.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from spikeguard.bus.kafka import KafkaBus
from spikeguard.schemas import Topics

sys.path.insert(0, str(Path(__file__).parents[1] / "producers"))
from test_late_decisions import late_decision

pytestmark = pytest.mark.kafka


def test_a_decision_that_comes_late_still_finds_its_checkpoint_on_kafka(kafka_bootstrap, tmp_path):
    bus = KafkaBus(kafka_bootstrap)
    try:
        late_decision(tmp_path, bus, Topics(f"late-{uuid.uuid4().hex[:8]}."))
    finally:
        bus.close()
