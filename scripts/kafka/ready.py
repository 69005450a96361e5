"""Wait until the local Kafka broker serves clients (used by scripts/kafka_local.sh).

usage: python ready.py HOST:PORT TIMEOUT_SECONDS

Ready means a metadata request is answered *and* the group coordinator is
available (asking for it makes the broker create __consumer_offsets now, so
the first consumer group of a test run does not pay for it). Exits 0 when
ready, 1 on timeout, printing the last error on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from kafka import KafkaAdminClient


def ready(bootstrap: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        admin = None
        left_ms = max(200, int((deadline - time.monotonic()) * 1000))
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=bootstrap,
                client_id="spikeguard-ready",
                bootstrap_timeout_ms=min(2000, left_ms),
                request_timeout_ms=min(5000, left_ms),
                reconnect_backoff_max_ms=500,
            )
            if not admin.describe_cluster().get("brokers"):
                raise RuntimeError("no broker in the metadata yet")
            admin.describe_groups(["spikeguard-ready"])
            return True
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = exc
            time.sleep(0.5)
        finally:
            if admin is not None:
                with contextlib.suppress(Exception):  # closing a client that never connected
                    admin.close()
    print(f"broker at {bootstrap} not ready after {timeout:.0f}s: {last!r}", file=sys.stderr)
    return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.CRITICAL)
    sys.exit(0 if ready(sys.argv[1], float(sys.argv[2])) else 1)
