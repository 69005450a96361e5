"""A worker's settings (``SPIKEGUARD_WORKER__<FIELD>``, ``--set worker.<field>=...``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.streaming.run_clock import DEFAULT_MAX_EPOCH_GAP, DEFAULT_MAX_STEP_GAP
from spikeguard.streaming.state_store import DEFAULT_MAX_RECORD_BYTES

#: An event is a few hundred bytes; a step with its top layers' norms a few kB.
DEFAULT_MAX_INPUT_RECORD_BYTES = 64 * 1024
#: ~10,000 runs fit a worker's 1 GiB; twice that before it refuses new ones.
DEFAULT_MAX_RUNS = 20_000


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_idle_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="a run with no record for this long is evicted from the worker's memory "
        "and its saved state tombstoned (a trainer that died never says it ended); a record "
        "arriving later starts the run afresh",
    )
    max_state_record_bytes: int = Field(
        DEFAULT_MAX_RECORD_BYTES,
        ge=1024,
        description="largest state record a worker writes (one run's state); a bigger one is "
        "refused with a logged reason and spikeguard_state_records_refused_total, never sent "
        "to a broker that would reject it (Kafka's default limit is 1 MiB)",
    )
    max_runs: int = Field(
        DEFAULT_MAX_RUNS,
        ge=1,
        description="most runs a worker holds state for; a record of a further run goes to the DLQ "
        "(TooManyRuns) and is counted in spikeguard_runs_refused_total, so a flood of made-up run "
        "ids cannot grow a worker's memory without bound (runs that end or idle out free their place)",
    )
    max_input_record_bytes: int = Field(
        DEFAULT_MAX_INPUT_RECORD_BYTES,
        ge=1024,
        description="largest input record a worker decodes; a bigger one goes to the DLQ unparsed "
        "(MessageTooLarge)",
    )
    unsigned_letters_per_10s: int = Field(
        1000,
        ge=0,
        description="with a key, dead letters written for unsigned steps, verdicts or decisions "
        "per 10 s at most (each refused unparsed); beyond, they are counted "
        "(spikeguard_dead_letters_total) and summed in one log line: a flood costs what "
        "dropping it costs",
    )
    max_step_gap: int = Field(
        DEFAULT_MAX_STEP_GAP,
        ge=1,
        description="a step, verdict, decision or checkpoint more than this many steps past the "
        "furthest its run has published is refused to the DLQ, never adopted as the run's newest "
        "step (one far-future record would make every real one look late)",
    )
    max_epoch_gap: int = Field(
        DEFAULT_MAX_EPOCH_GAP,
        ge=1,
        description="likewise for epochs (one per rollback): a record more than this many epochs "
        "past the run's newest is refused",
    )
    pulse_interval_s: float = Field(
        10.0,
        gt=0,
        description="the actuator tells each run's trainer at most this often that its steps are "
        "judged (a signed pulse action naming the newest step decided); keep it well below the "
        "trainers' guard.unprotected_after_s",
    )
    ended_run_metrics_linger_s: float = Field(
        60.0,
        ge=0,
        description="an ended or evicted run's per-run metric series are removed this long "
        "after it goes, so that the next Prometheus scrape still sees its last values",
    )
    max_unacked_records: int = Field(
        10_000,
        ge=0,
        description="outputs a worker may have sent and not yet seen acknowledged before it waits "
        "for the broker; it never waits per batch otherwise, only at its checkpoint (state and "
        "offsets are saved after every output before them is acknowledged). 0: wait after every batch",
    )
    embedded_batch_linger_s: float = Field(
        0.002,
        ge=0,
        le=1.0,
        description="in the embedded pipeline (worker threads in the trainer's process, or in "
        "its child process), how long a worker woken by new records waits for more before "
        "working on them: fewer wake-ups, less of the trainer's time and GIL, for this much "
        "added latency per hop (0: work on every wake-up); also the first pause of the child "
        "process's bridges",
    )
    embedded_process: bool = Field(
        True,
        description="embedded mode: run the pipeline's workers in a child process bridged to "
        "the trainer's in-process bus (their Python work does not share the trainer's GIL); "
        "where a child cannot start (Windows, no interpreter to launch) they run as threads "
        "of the trainer's process, said in one INFO line. false: always threads (the "
        "workers' objects and metrics registry in the trainer's process)",
    )
    embedded_bridge_max_linger_s: float = Field(
        0.05,
        ge=0,
        le=1.0,
        description="with the pipeline in a child process: how long a bridge keeps adding "
        "records to a batch while more keep coming (in steps of embedded_batch_linger_s) "
        "before sending it; an action is sent at once. Fewer wake-ups of the trainer's "
        "process for a fast run, at most this much added latency for decisions",
    )
    embedded_process_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="with the pipeline in a child process: its scheduling niceness (Unix, 0-19); "
        "above 0, when every core is busy the trainer runs first and the pipeline falls behind "
        "(it catches up when a core frees up; actions on steps too far back are refused as "
        "stale). 0: the trainer's own priority",
    )
