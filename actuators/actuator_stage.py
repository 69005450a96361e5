"""The actuator stage: decisions, checkpoints and acks in; signed actions out."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from pydantic import BaseModel, SecretStr

from spikeguard.schemas.signing import sign_action
from spikeguard.streaming.stage import Output, PerRunStage
from spikeguard.schemas import Ack, CheckpointEvent, Decision, Topics


class ActuatorStage(PerRunStage):
    name = "actuator"

    def __init__(
        self,
        topics: Topics,
        factory: Callable[[str], object],
        signing_key: SecretStr | None = None,
    ) -> None:
        super().__init__(topics, factory)
        self.signing_key = signing_key
        # Decisions a policy ignores on purpose (policy.counts), exported as increments.
        self._ignored: Counter[str] = Counter()

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {
            self.topics.decisions: Decision,
            self.topics.checkpoints: CheckpointEvent,
            self.topics.acks: Ack,
        }

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        out: list[Output] = []
        topic = self.topics.actions
        for _, event in items:
            policy = self.run(event.run_id)  # type: ignore[attr-defined]
            if isinstance(event, Decision):
                counts = dict(policy.counts)
                actions = policy.on_decision(event)
                if policy.counts != counts:  # duplicate, late, or from an abandoned timeline
                    for reason, n in policy.counts.items():
                        if n > counts.get(reason, 0):
                            self._ignored[f"{reason}_decision"] += n - counts.get(reason, 0)
            elif isinstance(event, CheckpointEvent):
                actions = policy.on_checkpoint(event)
            else:
                actions = policy.on_ack(event)
            for action in actions or ():
                if self.signing_key is not None:
                    action = sign_action(action, self.signing_key)
                out.append((topic, action))
        return out

    def drain_ignored(self) -> dict[str, int]:
        out = dict(self._ignored)
        self._ignored.clear()
        return out
