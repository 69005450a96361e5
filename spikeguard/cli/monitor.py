"""``spikeguard monitor``: watch every run on the bus; serve metrics; send alerts.

Reads steps, decisions, actions, acks and checkpoints, measures decision
latency and action round trips, serves ``/metrics`` (consumer lag of every
``{prefix}*`` group included) on ``--metrics-port``, and announces each
incident once to the channels in ``settings.alerting``:

  SPIKEGUARD_ALERTING__WEBHOOK_URL=https://hooks.slack.com/services/...
  SPIKEGUARD_ALERTING__EMAIL_TO=ops@example.org  SPIKEGUARD_ALERTING__SMTP_HOST=mail
  SPIKEGUARD_ALERTING__MIN_URGENCY=high   (none, low, medium, high, critical)

The embedded runtime runs the same monitor in-process when ``metrics_port``
or a channel is set. SIGTERM or Ctrl-C stops it after it saves its state.
"""

from __future__ import annotations

import argparse
import logging
import signal

from spikeguard.cli._common import add_settings_flags, settings_from

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "monitor",
        help="serve metrics (lag, latency) and send alerts for every run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spikeguard.runtime.monitoring import build_monitor
    from spikeguard.metrics import default_metrics
    from spikeguard.runtime import make_bus
    from spikeguard.schemas import Topics

    settings = settings_from(args, metrics_port=args.metrics_port)
    bus = make_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.all())
    metrics = default_metrics()
    server = None
    if settings.metrics_port is not None:
        from spikeguard.metrics_http import serve

        server = serve(settings.metrics_port, metrics.registry, bus=bus, group_prefix=topics.prefix)
    worker, notifier = build_monitor(
        bus, settings, topics, metrics, snapshot_interval_s=settings.snapshot_interval_s
    )

    def stop(signum: int, _frame: object) -> None:
        log.warning("signal %d: stopping", signum)
        worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"spikeguard monitor on {settings.engine} ({settings.bootstrap_servers or 'in-process'}), "
        f"prefix {settings.topic_prefix!r}, alerts to {', '.join(notifier.channels)}"
        + (f", metrics on :{settings.metrics_port}" if server else ""),
        flush=True,
    )
    try:
        worker.run()
    finally:
        notifier.close()
        if server is not None:
            server.close()
        bus.close()
    return 0
