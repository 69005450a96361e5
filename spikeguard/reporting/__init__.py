"""Reports a person reads: a recorded run as a PNG and an HTML page.

``load`` reads a recording (the embedded bus's directory, a JSONL export, or
a bus), ``timeline`` turns its events into incidents, actions and rollbacks,
``figure`` draws them with matplotlib (the ``[report]`` extra), and ``page``
writes the HTML.
"""

from spikeguard.reporting.load import (
    ReportError,
    RunRecord,
    export_jsonl,
    load_bus,
    load_directory,
    load_jsonl,
)
from spikeguard.reporting.timeline import Timeline, build_timeline

__all__ = [
    "ReportError",
    "RunRecord",
    "Timeline",
    "build_timeline",
    "export_jsonl",
    "load_bus",
    "load_directory",
    "load_jsonl",
]
