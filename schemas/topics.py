"""Topic names: ``{prefix}{name}``; a replay runs the pipeline under another prefix."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "spikeguard."
TOPICS = (
    "steps",
    "verdicts",
    "step-verdicts",
    "decisions",
    "actions",
    "acks",
    "checkpoints",
    "dlq",
)


@dataclass(frozen=True)
class Topics:
    """The full topic names under one prefix.

    >>> Topics().steps
    'spikeguard.steps'
    >>> Topics("replay.").decisions
    'replay.decisions'
    """

    prefix: str = DEFAULT_PREFIX

    @property
    def steps(self) -> str:
        return self.prefix + "steps"

    @property
    def verdicts(self) -> str:
        return self.prefix + "verdicts"

    @property
    def step_verdicts(self) -> str:
        """Each step's verdicts from a co-hosted detector worker, one record (StepVerdicts)."""
        return self.prefix + "step-verdicts"

    @property
    def decisions(self) -> str:
        return self.prefix + "decisions"

    @property
    def actions(self) -> str:
        return self.prefix + "actions"

    @property
    def acks(self) -> str:
        return self.prefix + "acks"

    @property
    def checkpoints(self) -> str:
        return self.prefix + "checkpoints"

    @property
    def runs(self) -> str:
        """Run start/end and the run's settings (RunEvent), compacted, keyed by run_id.

        Not in ``all()``: it must be created compacted (``create_topics(..., compacted=True)``).
        """
        return self.prefix + "runs"

    @property
    def dlq(self) -> str:
        return self.prefix + "dlq"

    def all(self) -> list[str]:
        return [self.prefix + name for name in TOPICS]

    def compacted(self) -> list[str]:
        """The topics that must be created compacted (``create_topics(..., compacted=True)``).

        Create them before anything creates them plain: a worker creates its inputs
        (fusion and the actuator read ``runs``) when it starts.
        """
        return [self.runs]

    def state(self, component: str) -> str:
        """The compacted topic holding a component's state snapshots."""
        return f"{self.prefix}state.{component}"
