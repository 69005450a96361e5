"""The package's exceptions: one root, narrow subclasses where callers must tell them apart."""

from __future__ import annotations


class SpikeguardError(Exception):
    """Root of every error spikeguard raises on purpose."""


class ConfigError(SpikeguardError, ValueError):
    """A setting is missing or invalid; the message names the field."""


class SchemaError(SpikeguardError, ValueError):
    """A message could not be decoded into an event; the message says why."""


class MalformedMessage(SchemaError):
    """Not JSON, not an object, or a field of the wrong type or range."""


class UnknownSchemaVersion(SchemaError):
    """A record written by a newer (or unknown) version of spikeguard."""


class MessageTooLarge(SchemaError):
    """A message over the size limit; refused before parsing."""


class BusError(SpikeguardError):
    """The bus could not publish, poll or commit."""


class DeliveryError(BusError):
    """The broker did not acknowledge a published record."""


class CommitRefused(BusError):
    """The group refused a commit: it moved on without this member (a broker outage longer
    than the session, a rebalance under way). Nothing is lost: the member rejoins at its
    next poll, its partitions' state and positions come back from its snapshot, and what
    was not committed is read again."""


class ActionRejected(SpikeguardError):
    """An action failed its signature check or names an impossible step."""


class RecordRejected(SpikeguardError):
    """A decodable record a stage refuses (``Stage.admit``): the worker sends it to the DLQ with the reason."""


class RecordNotAuthenticated(RecordRejected):
    """A record without a valid signature of its producer's key (forged, or from a process without the key)."""


class RecordOfOtherSession(RecordRejected):
    """A genuine record of another trainer session of the run (an older one, replayed): it moves nothing."""


class RecordBeyondRunClock(RecordRejected):
    """A step, epoch, decision or checkpoint far beyond what its run has published: never a high-water mark."""


class TooManyRuns(RecordRejected):
    """A record of a run a worker does not hold, when it already holds as many runs as it may."""


class StepRejected(RecordRejected):
    """A decodable step event a detector stage refuses to judge; the message says why."""


class StepNotAuthenticated(StepRejected, RecordNotAuthenticated):
    """A step event without a valid signature of the run's key (forged, or from a keyless trainer)."""


class StepOutOfOrder(StepRejected):
    """A step at or before one already judged in the same epoch (a replay, or forged)."""


class RunSettingsRejected(RecordRejected):
    """A run's settings (RunEvent preset or overrides) that do not validate; the run keeps the defaults."""


class RunEventNotAuthenticated(RecordNotAuthenticated):
    """A run start or end without a valid signature of the run's key; it changes nothing (forged, or keyless)."""
