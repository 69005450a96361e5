"""Several detectors in one worker: a step is consumed, decoded and authenticated once.

``spikeguard worker detectors`` runs the four detector stages behind one
consumer of the steps (and runs) topics instead of four: on Kafka each
independent detector worker fetches, decodes and checks the signature of
every step itself, and that framework cost (not the detectors' own logic) is
most of a detector worker's CPU. Each detector still judges exactly as its
own worker would (same detector name, same values), and a step's verdicts
leave as one :class:`~spikeguard.schemas.StepVerdicts` record on the
``step-verdicts`` topic, signed once: fusion decodes and authenticates one
record per step instead of one per detector. Should the detectors' outputs not
line up step by step (a detector judging a step another has not, out of
order), the batch's verdicts go out one per record on ``verdicts`` instead,
so no detector's verdicts ever reach fusion out of order. The batch commits
after all of them are acknowledged.

On Kafka the independent workers stay the default (docs/design.md): they
scale and fail one detector at a time. The embedded runtime runs this stage
(``components.EMBEDDED_COMPONENTS``): a step's verdicts reach fusion together
and in detector order, as the backtest hands them over. The two layouts do not share consumer groups or
saved state (``{prefix}detectors`` and ``state.detectors`` here), so a switch
from one to the other judges the retained steps again under the new group;
fusion drops the verdicts it already has (duplicates) and decides nothing twice.

Every hosted detector sees the same records in the same order, so they hold
the same runs at all times; the first one's bookkeeping (admission, idle
times) speaks for all.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from pydantic import BaseModel

from spikeguard.processors.detector_stage import DetectorStage
from spikeguard.schemas import StepVerdicts, Verdict
from spikeguard.streaming.stage import Output, Stage

#: The worker name (and consumer group / state suffix) of the co-hosted detectors.
COHOSTED = "detectors"


class CoHostedDetectors(Stage):
    """One stage made of several :class:`DetectorStage` reading the same inputs.

    Its state is ``{run_id: {detector: state}}``: a batch that fails is rewound
    for every detector at once, so a retry counts nothing twice in any of them.
    """

    name = COHOSTED

    def __init__(self, stages: Sequence[DetectorStage]) -> None:
        if not stages:
            raise ValueError("CoHostedDetectors needs at least one detector stage")
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"CoHostedDetectors: detector names repeat: {names}")
        super().__init__(stages[0].topics)
        self.stages = list(stages)
        inputs = [stage.inputs() for stage in stages]
        if any(i != inputs[0] for i in inputs):
            raise ValueError("CoHostedDetectors: the detector stages must read the same topics")
        self._inputs = inputs[0]
        # Signature and order checks once per step, not once per detector (see the module doc).
        self.admit = stages[0].admit

    @property
    def runs(self) -> dict[str, Any]:
        """The runs held (the same in every hosted detector)."""
        return self.stages[0].runs

    @property
    def signing_key(self) -> Any:
        """The detectors' key: the worker signs every hosted detector's verdicts with it."""
        return self.stages[0].signing_key

    def inputs(self) -> dict[str, type[BaseModel]]:
        return dict(self._inputs)

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        out: list[Output] = []
        for stage in self.stages:
            out += stage.handle_batch(items)
        return self.packed(out)

    def packed(self, outputs: list[Output]) -> list[Output]:
        """The hosted detectors' verdicts as one StepVerdicts record per step, in judging order.

        Unchanged (one Verdict per record) when packing would reorder a detector's own
        verdicts, give one detector two verdicts on a step, or when anything but verdicts is
        among them: fusion reads both topics, and order within a detector is what it relies on.
        """
        if not outputs:
            return outputs
        verdicts_topic = self.topics.verdicts
        steps: dict[tuple[str, int, int], list[Verdict]] = {}
        place: dict[tuple[str, int, int], int] = {}
        last: dict[str, int] = {}  # detector -> place of its newest verdict's step
        for topic, verdict in outputs:
            if topic != verdicts_topic or type(verdict) is not Verdict:
                return outputs
            key = (verdict.run_id, verdict.epoch, verdict.step)
            at = place.get(key)
            if at is None:
                at = len(place)  # steps are numbered in the order they first appear
                place[key] = at
                steps[key] = [verdict]
            else:
                steps[key].append(verdict)
            if last.get(verdict.detector, -1) >= at:  # out of order, or twice for one step
                return outputs
            last[verdict.detector] = at
        topic = self.topics.step_verdicts
        # Built without validation: the checks above are what StepVerdicts' validator checks.
        return [
            (
                topic,
                StepVerdicts.model_construct(run_id=run_id, step=step, epoch=epoch, verdicts=group),
            )
            for (run_id, epoch, step), group in steps.items()
        ]

    def snapshot(self, run_ids: Iterable[str]) -> dict[str, Any]:
        return self._by_run([stage.snapshot for stage in self.stages], run_ids)

    def undo_point(self, run_ids: Iterable[str]) -> dict[str, Any]:
        return self._by_run([stage.undo_point for stage in self.stages], run_ids)

    def _by_run(self, takes: list, run_ids: Iterable[str]) -> dict[str, Any]:
        """``{run_id: {detector: state}}`` from each hosted stage's ``take(run_ids)``."""
        run_ids = list(run_ids)
        state: dict[str, dict[str, Any]] = {}
        for stage, take in zip(self.stages, takes):
            for run_id, run_state in take(run_ids).items():
                state.setdefault(run_id, {})[stage.name] = run_state
        return state

    def restore(self, state: dict[str, Any]) -> None:
        for run_id, per_detector in state.items():
            if not isinstance(per_detector, dict):
                raise TypeError(
                    f"co-hosted detector state of run {run_id!r} is not a dict by detector"
                )
        for stage in self.stages:
            # A run saved without this detector (one added since) starts afresh in it.
            stage.restore(
                {run_id: per[stage.name] for run_id, per in state.items() if stage.name in per}
            )
            stage.forget([run_id for run_id, per in state.items() if stage.name not in per])

    def forget(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        for stage in self.stages:
            stage.forget(run_ids)

    def end_runs(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        for stage in self.stages:
            stage.end_runs(run_ids)

    def drain_ended(self) -> list[str]:
        ended: dict[str, None] = {}
        for stage in self.stages:
            ended.update(dict.fromkeys(stage.drain_ended()))
        return list(ended)

    def touch(self, run_ids: Iterable[str], now: float) -> None:
        run_ids = list(run_ids)
        for stage in self.stages:
            stage.touch(run_ids, now)

    def idle_runs(self, now: float, ttl_s: float) -> list[str]:
        return self.stages[0].idle_runs(now, ttl_s)

    def flush_runs(self, run_ids: Iterable[str]) -> list[Output]:
        run_ids = list(run_ids)
        out: list[Output] = []
        for stage in self.stages:
            out += stage.flush_runs(run_ids)
        return self.packed(out)

    def flush(self) -> list[Output]:
        out: list[Output] = []
        for stage in self.stages:
            out += stage.flush()
        return self.packed(out)

    def tick(self, now: float) -> list[Output]:
        out: list[Output] = []
        for stage in self.stages:
            out += stage.tick(now)
        return self.packed(out)

    def drain_ignored(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for stage in self.stages:
            for reason, count in stage.drain_ignored().items():
                total[reason] = total.get(reason, 0) + count
        return total
