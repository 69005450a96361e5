"""benchmarks/bench_kafka_throughput.py's work floor: the Kafka row's limit counts every hop's own work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    from bench_kafka_throughput import _values, limit, mean_floor, wire_pipeline, work_floor
    from kafka_pipeline import new_key
finally:
    sys.path.remove(str(BENCH))


def test_the_floor_admits_and_judges_every_step_at_every_hop_and_names_what_earlier_floors_left_out():
    key = new_key()
    wire: dict = {}
    floor = work_floor(_values(runs=4, steps=160, key=key), key, wire=wire)
    assert floor["decisions"] == floor["steps"] == 160
    rows = floor["cpu_us_per_step"]
    for hop in ("detectors", "fusion", "actuator"):  # the actuator's policy was left out before
        assert f"admit {hop}" in rows and f"judge {hop}" in rows
    for record in ("steps", "step-verdicts", "decisions"):
        assert f"check {record}" in rows and f"codec {record}" in rows
    assert set(floor["without"]) <= set(rows)

    cap = limit(floor, client_us=4.0, cores=2)
    assert cap["floor_us_per_step"] == round(floor["cpu_us_per_step_total"] + 3 * 4.0, 1)
    left_out = sum(rows[name] for name in floor["without"])
    assert abs(cap["floor_us_per_step_as_before"] - (cap["floor_us_per_step"] - left_out)) < 0.2
    assert cap["steps_per_s"] <= 2e6 / cap["floor_us_per_step"] + 1

    # The client timed on each hop's own records: what travels there, one record per step.
    assert [len(wire[hop]) for hop in ("step-verdicts", "decisions")] == [160, 160]
    by_hop = {"steps": 4.0, "step-verdicts": 7.0, "decisions": 5.0}
    cap = limit(floor, client_us=4.0, cores=2, client_by_hop=by_hop)
    assert cap["floor_us_per_step"] == round(floor["cpu_us_per_step_total"] + 16.0, 1)
    assert abs(cap["floor_us_per_step_as_before"] - (cap["floor_us_per_step"] - 4 - left_out)) < 0.2


def test_the_floor_read_is_the_mean_of_the_floors_measured_around_the_pipeline():
    def floor(scale: float) -> dict:
        rows = {"judge detectors": 60.0 * scale, "check steps": 20.0 * scale}
        return {
            "steps": 10,
            "decisions": 10,
            "cpu_us_per_step": rows,
            "cpu_us_per_step_total": 80.0 * scale,
            "detectors_process_us": 80.0 * scale,
            "without": [],
        }

    mean = mean_floor([floor(1.0), floor(1.5)])
    assert mean["cpu_us_per_step"] == {"judge detectors": 75.0, "check steps": 25.0}
    assert mean["cpu_us_per_step_total"] == mean["detectors_process_us"] == 100.0
    assert mean["each"] == [80.0, 120.0]


@pytest.mark.heavy  # three workers built and run in this process: ~1-4 s
def test_the_workers_on_the_wire_decide_every_step_as_the_floor_does():
    key = new_key()
    records = _values(runs=4, steps=160, key=key)
    wire = wire_pipeline(records, key)
    assert wire["decisions"] == 160  # signed, checked and decided at every hop: none refused
    assert set(wire["cpu_us_per_step"]) == {"detectors", "fusion", "actuator"}
