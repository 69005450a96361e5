"""Who may steer a run: the signing key every process of a pipeline needs.

Every record that can lead to an action carries an HMAC of its producer
(schemas/signing.py): steps, run events, checkpoint events and acks by the
trainer, verdicts by the detector workers, decisions by fusion, actions by the
actuator; every consumer refuses the others to the DLQ. Without a key a trainer
would obey anything written to the actions topic, and the actuator act on any
decision, so:

- **Kafka**: the guard and every worker (detectors, fusion, actuator) refuse
  to start without ``SPIKEGUARD_SIGNING_KEY``, unless the user opts out with
  ``--insecure`` / ``SPIKEGUARD_INSECURE=1``; the opt-out is one WARNING line
  at start. One key serves every role: a forger without it can neither steer
  nor disarm a run.
- **Embedded**: the trainer and its pipeline threads are one process, so a
  random key made at start (and never shown) is all they need to share.
"""

from __future__ import annotations

import logging
import secrets

from pydantic import SecretStr

from spikeguard.errors import ConfigError
from spikeguard.settings import Settings

log = logging.getLogger(__name__)


class MissingSigningKey(ConfigError):
    """On Kafka, a process that signs or obeys actions has no key and no explicit opt-out."""


def ensure_signing_key(settings: Settings, who: str) -> Settings:
    """``settings`` with a signing key, or with the user's explicit opt-out; else raise.

    ``who`` names the process in the messages ("the trainer's guard",
    "the actuator worker").
    """
    if settings.keys() is not None:
        return settings
    if settings.engine == "embedded":
        # Shared by the guard and the in-process actuator through these settings.
        return settings.model_copy(update={"signing_key": SecretStr(secrets.token_hex(32))})
    if settings.insecure:
        log.warning(
            "spikeguard: INSECURE: %s runs without a signing key (--insecure / SPIKEGUARD_INSECURE=1): "
            "nothing it publishes is signed and nothing it reads is checked, anyone who can write "
            "the %s* topics steers the run",
            who,
            settings.topic_prefix,
        )
        return settings
    raise MissingSigningKey(
        f"{who} refuses to start on Kafka without a signing key: set SPIKEGUARD_SIGNING_KEY "
        "(the same secret for the trainers and the workers), or opt out explicitly with "
        "--insecure / SPIKEGUARD_INSECURE=1"
    )
