"""Which trainer session each run is in: another session's records move nothing.

Every record a trainer publishes names its session, a nonce its Guard drew at
start and signed into the record (:func:`spikeguard.schemas.ids.new_session`:
its start time first, so a later session compares greater). A genuine record
of an earlier session of the same run id, re-published by anyone who read it,
passes the signature check; what stops it is this table:

- a run's first record names its session (its start, usually), and that is the
  run's session from then on;
- a record of a **newer** session is the run starting again (a resume, a
  re-run): the run's judging state starts afresh with it
  (:meth:`SessionTable.enter`), whatever the older session left;
- a record of an **older** session, or one naming no session once the run has
  one, is refused (:class:`~spikeguard.errors.RecordOfOtherSession`: the
  worker sends it to the DLQ with the reason) and changes nothing.

Records from a trainer that predates sessions name none; a run that never
names one is judged as before. Only a holder of the trainer key can make a
newer session: that is starting the run again, and the run's own Guard then
sees pulses of a session that is not its own and says so.
"""

from __future__ import annotations

from typing import Callable, Iterable

from spikeguard.errors import RecordOfOtherSession


class SessionTable:
    """The session each run is admitted in, and the one its state was built in.

    Admission (:meth:`admit`, before a batch is handled) and handling
    (:meth:`enter`, record by record) are apart because a worker admits a
    whole batch first: the run's state must start afresh at the first record
    of the new session, not before the older records ahead of it are handled.
    """

    def __init__(self) -> None:
        self.admitted: dict[str, str] = {}  # run_id -> newest session admitted
        self.handled: dict[str, str] = {}  # run_id -> session the run's state is of

    def admit(self, run_id: str, session: str | None, what: Callable[[], str]) -> bool:
        """Raise RecordOfOtherSession (naming ``what()``) unless ``session`` is the run's or newer;
        True when it is newer than the one admitted so far (the run starts again).

        ``what`` says which record it is, called only to refuse: every record is admitted,
        few are refused, and the words cost more than the check.
        """
        now = self.admitted.get(run_id)
        if session is not None and (now is None or session >= now):
            self.admitted[run_id] = session
            return now is not None and session != now
        if now is None:  # neither names one: a trainer from before sessions
            return False
        whose = "names no session" if session is None else f"is of session {session}"
        raise RecordOfOtherSession(
            f"run {run_id}: {what()} {whose}, older than the run's session {now} (a genuine "
            "record of an earlier run of this run id, replayed, or a trainer still running "
            "beside a newer one); refused, the run's state is unchanged"
        )

    def enter(self, run_id: str, session: str | None) -> bool:
        """A record of ``session`` is handled now: True when it starts the run afresh
        (a newer session than the one its state was built in)."""
        held = self.handled.get(run_id)
        if session is None or session == held:
            return False
        self.handled[run_id] = session
        return held is not None

    def state(self, run_id: str) -> str | None:
        return self.handled.get(run_id) or self.admitted.get(run_id)

    def restore(self, run_id: str, session: str | None) -> None:
        if session is None:
            self.forget([run_id])
        else:
            self.admitted[run_id] = self.handled[run_id] = session

    def forget(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self.admitted.pop(run_id, None)
            self.handled.pop(run_id, None)


def session_of(record: object) -> str | None:
    """The session a record names: its own, or (a step's verdicts) its first verdict's."""
    # A record's fields are its __dict__: asking a pydantic model for a field it lacks raises
    # and formats an AttributeError inside getattr (~5 µs, once a record at every hop).
    fields = getattr(record, "__dict__", None) or {}
    found = fields.get("session")
    if found is None:
        verdicts = fields.get("verdicts")
        if verdicts:
            found = getattr(verdicts[0], "session", None)
    return found
