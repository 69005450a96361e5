"""Fixtures shared by every test package, and the rule that sorts tests into tiers.

Every test not marked ``kafka``, ``slow``, ``pipeline`` or ``heavy`` is marked ``unit``:
``pytest -m unit`` is the fast tier (no broker, no child process, no long training).
``kafka`` and ``pipeline`` are found from the test's code (see :func:`_tier_markers`);
``slow`` and ``heavy`` are written on the tests that measured slow.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

#: The markers that keep a test out of the unit tier.
OUTSIDE_UNIT = ("kafka", "slow", "pipeline", "heavy")

#: Code that starts another process or the pipeline's workers: a test whose code, module
#: helpers or fixtures contain one of these is marked ``pipeline``.
STARTS_PROCESSES = re.compile(
    r"\bsubprocess\b|\bPopen\b|\bmultiprocessing\b|\bmp\.spawn\b|\bstart_processes\b|\bos\.fork\b"
    r"|\bsys\.executable\b|\bSPIKEGUARD_PYTHON\b|\bopen_runtime\(|\bstart_workers\(|\bembedded_process\b"
)

#: A unit test that takes longer than this (wall seconds, setup included) is named at the end of a
#: ``-m unit`` run: it belongs in ``heavy`` (or ``pipeline``), not in the fast tier.
UNIT_BUDGET_S = 3.0


@functools.cache
def _module_helpers_source(path: Path) -> str:
    """The module's code outside its imports, test functions and fixtures: its helpers.

    An import starts nothing, one test's code says nothing about its neighbours, and a
    fixture counts for the tests that use it."""
    source = path.read_text()
    lines = source.splitlines()

    def left_out(node: ast.AST) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        return node.name.startswith("test") or any(
            "fixture" in ast.unparse(d) for d in node.decorator_list
        )

    for node in filter(left_out, ast.walk(ast.parse(source))):
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        for index in range(first - 1, node.end_lineno or node.lineno):
            lines[index] = ""
    return "\n".join(lines)


@functools.cache
def _source_of(function: Callable) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # built in, or made at run time
        return ""


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test's own code, its module's helpers or its fixtures start a process."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    texts = [_source_of(function), _module_helpers_source(Path(str(item.path)))]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        texts.extend(_source_of(definition.func) for definition in definitions)
    return any(STARTS_PROCESSES.search(text) for text in texts)


def _tier_markers(item: pytest.Item) -> list[str]:
    """The markers the rule adds to ``item``."""
    added = []
    if "kafka_bootstrap" in item.fixturenames and item.get_closest_marker("kafka") is None:
        added.append("kafka")
    if item.get_closest_marker("pipeline") is None and _starts_processes(item):
        added.append("pipeline")
    marked = {marker.name for marker in item.iter_markers()} | set(added)
    if not marked & set(OUTSIDE_UNIT):
        added.append("unit")
    return added


#: The order modules run in: the longest tiers first, so that on two processes (pytest-xdist) the
#: last test to finish is a short one and neither process waits long on the other.
RUN_ORDER = ("slow", "kafka", "pipeline", "heavy", "unit")


def _rank(item: pytest.Item) -> int:
    return next(
        rank for rank, name in enumerate(RUN_ORDER) if item.get_closest_marker(name) is not None
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in _tier_markers(item):
            item.add_marker(name)
    # Whole modules move (their module-scoped fixtures are set up once), in their own order otherwise.
    module_rank: dict[str, int] = {}
    for item in items:
        module = str(item.path)
        module_rank[module] = min(module_rank.get(module, len(RUN_ORDER)), _rank(item))
    items.sort(key=lambda item: module_rank[str(item.path)])


_unit_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "unit" in report.keywords:
        _unit_durations[report.nodeid] = _unit_durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    over = sorted(
        ((seconds, test) for test, seconds in _unit_durations.items() if seconds > UNIT_BUDGET_S),
        reverse=True,
    )
    if over:
        terminalreporter.section(
            f"unit tests over {UNIT_BUDGET_S:.0f} s (mark them heavy or pipeline)"
        )
        for seconds, test in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {test}")


class GatedProducer:
    """A real embedded producer behind a gate: the bus is 'away' until ``gate`` is set.
    ``waiting`` is set once a sender hangs on the gate with its first record."""

    def __init__(self, bus, gate=None, inner=None) -> None:
        import threading

        self.inner = inner if inner is not None else bus.producer()
        self.gate = gate or threading.Event()
        self.waiting = threading.Event()

    def publish(self, topic, value, key=None, headers=None):
        self.waiting.set()
        self.gate.wait()
        self.inner.publish(topic, value, key=key, headers=headers)

    def flush(self, timeout=None):
        self.inner.flush(timeout)

    def close(self):
        self.inner.close()


@pytest.fixture
def gated_producer():
    """``gated_producer(bus)``: see :class:`GatedProducer`."""
    return GatedProducer


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _broker_problem(bootstrap: str, timeout: float = 5.0) -> str | None:
    """Why no Kafka broker serves clients at ``bootstrap``, or None when one does."""
    from kafka import KafkaAdminClient

    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:  # a closed port answers at once; the client would retry until its timeout
        socket.create_connection((host or "127.0.0.1", int(port or 9092)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        return repr(exc)
    admin = None
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap,
            client_id="spikeguard-tests-probe",
            bootstrap_timeout_ms=int(timeout * 1000),
            request_timeout_ms=int(timeout * 1000),
        )
        if not admin.describe_cluster().get("brokers"):
            return "the cluster reports no broker"
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return repr(exc)
    finally:
        if admin is not None:
            admin.close()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Address of the test broker (``SPIKEGUARD_TEST_BOOTSTRAP``, default 127.0.0.1:9092).

    Without a reachable broker the test is skipped, except in CI (``CI`` set)
    or with ``SPIKEGUARD_REQUIRE_KAFKA=1``, where it fails: there a skipped
    Kafka test would hide a broken setup.
    """
    bootstrap = os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP", "127.0.0.1:9092")
    problem = _broker_problem(bootstrap)
    if problem is not None:
        message = (
            f"no Kafka broker reachable at {bootstrap} ({problem}); "
            "start one with `scripts/kafka_local.sh start` (or point SPIKEGUARD_TEST_BOOTSTRAP at one)"
        )
        if _truthy("CI") or os.environ.get("SPIKEGUARD_REQUIRE_KAFKA") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return bootstrap


def stderr_of(command: list[str], on_a_terminal: bool) -> str:
    """What ``command`` writes to stderr when stderr is a real pseudo-terminal, or a pipe."""
    import pty
    import subprocess

    if not on_a_terminal:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower) as process:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(timeout=300) == 0
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture
def terminal_stderr():
    """``terminal_stderr(command, on_a_terminal)``: see :func:`stderr_of`."""
    return stderr_of


@pytest.fixture
def regression_loader():
    """``make(samples)``: a seeded noisy linear regression as a shuffled DataLoader (batch 32).

    What the guarded end-to-end runs train on: small enough for CPU, and its loss is
    steady enough that an injected spike is the only incident.
    """
    import torch

    def make(samples: int = 8192):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(samples, 8, generator=generator)
        y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(
            samples, 1, generator=generator
        )
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True
        )

    return make


@pytest.fixture
def spiked_step():
    """``step(guard, model, optimizer, x, y, bad_batches)``: one guarded step of the regression runs.

    A batch whose index is in ``bad_batches`` has its targets corrupted (x40 + 25): a real,
    persistent loss spike, the incident the guarded end-to-end runs must roll back.
    """
    import torch

    def step(guard, model, optimizer, x, y, bad_batches) -> None:
        if guard.loader.last_index in bad_batches:
            y = y * 40.0 + 25.0
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)

    return step


def wait_until(
    check: Callable[[], object], what: str, within_s: float = 60.0, every_s: float = 0.05
) -> object:
    """Poll ``check`` until it returns something true, and return that; fail naming ``what``
    after ``within_s`` (a bound on a hung pipeline, not a speed check)."""
    deadline = time.monotonic() + within_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what}")
        time.sleep(every_s)


@pytest.fixture(name="wait_until", scope="session")
def wait_until_fixture():
    """``wait_until(check, what, within_s=60, every_s=0.05)``: see :func:`wait_until`."""
    return wait_until


def consumed_by(runtime, component: str, topic: str) -> float:
    """How many records of ``topic`` the embedded runtime's ``component`` has taken in.

    A worker finishes the batch it took before it stops, so once this reaches a count, closing
    the runtime leaves none of those records unanswered."""
    if runtime.child is not None:
        families = runtime.child.metrics()
    else:  # the workers run as threads here, on the process's default registry
        from prometheus_client import REGISTRY

        families = list(REGISTRY.collect())
    return sum(
        sample.value
        for family in families
        if family.name == "spikeguard_records_consumed"
        for sample in family.samples
        if sample.name.endswith("_total")
        and sample.labels.get("component") == component
        and sample.labels.get("topic") == topic
    )


@pytest.fixture(name="consumed_by", scope="session")
def consumed_by_fixture():
    """``consumed_by(runtime, component, topic)``: see :func:`consumed_by`."""
    return consumed_by
