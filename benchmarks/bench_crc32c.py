"""kafka-python with and without the ``crc32c`` C package, on a real broker.

    python benchmarks/bench_crc32c.py [--bootstrap 127.0.0.1:9092] [--records 50000] [--json out.json]

kafka-python checksums every v2 record batch with CRC-32C: when producing,
and (``check_crcs``, on by default) when consuming. It uses the ``crc32c``
package when importable, else a pure-Python loop. Each mode runs in a fresh
child process (the pure-Python one with ``crc32c`` blocked from import) and
measures, on real StepEvent records (~600 bytes of JSON):

- ``produce``: publish N records and flush (a trainer's or a worker's output);
- ``consume+produce``: a consumer group member polls them and republishes
  each to another topic, flushing and committing per batch, the raw loop of
  a pipeline worker without its detector.

A benchmark, not a test: it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

MODES = ("pure-python", "crc32c")


def child(mode: str, bootstrap: str, records: int) -> dict:
    if mode == "pure-python":
        sys.modules["crc32c"] = None  # type: ignore[assignment]  # import crc32c now fails
    import kafka.record.util as util

    from spikeguard.bus.kafka import KafkaBus
    from spikeguard.lab.simulate import generate
    from spikeguard.schemas import encode

    using_c = util._crc32c is not util.crc32c_py
    assert using_c == (mode == "crc32c"), (mode, using_c)
    values = [encode(e) for e in generate("stable", records, seed=0, run_id="crc-run").events]
    source, sink = f"crc-{uuid.uuid4().hex[:8]}", f"crc-{uuid.uuid4().hex[:8]}"
    bus = KafkaBus(bootstrap, partitions=4)
    bus.create_topics([source, sink])

    producer = bus.producer()
    started = time.perf_counter()
    for i, value in enumerate(values):
        producer.publish(source, value, key=f"run-{i % 16}")
    producer.flush()
    produce_s = time.perf_counter() - started

    consumer = bus.consumer(f"crc-bench-{uuid.uuid4().hex[:6]}", [source])
    done = 0
    loop_started: float | None = None  # at the first batch polled, not at subscribing
    while done < records:
        batch = consumer.poll(max_records=500, timeout=1.0)
        if not batch:
            continue
        loop_started = loop_started or time.perf_counter()
        for record in batch:
            assert record.value is not None  # every record here was published with a value
            producer.publish(sink, record.value, key=record.key)
        producer.flush()
        consumer.commit()
        done += len(batch)
    assert loop_started is not None
    loop_s = time.perf_counter() - loop_started
    consumer.close()
    producer.close()
    bus.close()
    return {
        "mode": mode,
        "records": records,
        "bytes_per_record": sum(map(len, values)) // records,
        "produce_per_s": round(records / produce_s),
        "consume_produce_per_s": round(records / loop_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--bootstrap", default=os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP", "127.0.0.1:9092")
    )
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.bootstrap, args.records)))
        return
    results = []
    for mode in MODES:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--bootstrap",
                args.bootstrap,
                "--records",
                str(args.records),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"{mode:12s} produce {r['produce_per_s']:>7,}/s   consume+produce {r['consume_produce_per_s']:>7,}/s"
            f"   ({r['bytes_per_record']} B/record)",
            flush=True,
        )
    pure, c = results
    print(
        f"crc32c speed-up: produce x{c['produce_per_s'] / pure['produce_per_s']:.2f}, "
        f"consume+produce x{c['consume_produce_per_s'] / pure['consume_produce_per_s']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
