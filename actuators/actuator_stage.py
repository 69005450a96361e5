"""The actuator stage: decisions, checkpoints and acks in; signed actions out."""

from __future__ import annotations

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
                actions = policy.on_decision(event)
            elif isinstance(event, CheckpointEvent):
                actions = policy.on_checkpoint(event)
            else:
                actions = policy.on_ack(event)
            for action in actions or ():
                if self.signing_key is not None:
                    action = sign_action(action, self.signing_key)
                out.append((topic, action))
        return out
