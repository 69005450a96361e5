"""Every event spikeguard moves, its JSON encoding and the topic names.

>>> from spikeguard.schemas import StepEvent, encode, decode
>>> event = StepEvent(run_id="r1", step=3, loss=float("nan"))
>>> decode(encode(event), StepEvent).loss
nan
"""

from spikeguard.schemas.codec import (
    MAX_MESSAGE_BYTES,
    decode,
    decode_any,
    encode,
    json_schemas,
)
from spikeguard.schemas.events import (
    MAX_COUNTER,
    SCHEMA_VERSION,
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    BatchStats,
    CheckpointEvent,
    Claim,
    DeadLetter,
    Decision,
    Evidence,
    HealthLevel,
    RunEvent,
    StepEvent,
    StepVerdicts,
    Urgency,
    Verdict,
    WITHHELD,
)
from spikeguard.schemas.ids import action_id, decision_id, incident_id, new_session
from spikeguard.schemas.signing import sign_action, sign_step, step_signature_problem, verify_action
from spikeguard.schemas.topics import TOPICS, Topics

__all__ = [
    "sign_action",
    "sign_step",
    "step_signature_problem",
    "verify_action",
    "MAX_COUNTER",
    "MAX_MESSAGE_BYTES",
    "SCHEMA_VERSION",
    "TOPICS",
    "Ack",
    "AckStatus",
    "Action",
    "ActionKind",
    "AnomalyType",
    "BatchStats",
    "CheckpointEvent",
    "Claim",
    "DeadLetter",
    "Decision",
    "Evidence",
    "HealthLevel",
    "RunEvent",
    "StepEvent",
    "StepVerdicts",
    "Topics",
    "Urgency",
    "Verdict",
    "WITHHELD",
    "action_id",
    "decision_id",
    "decode",
    "decode_any",
    "encode",
    "incident_id",
    "new_session",
    "json_schemas",
]
