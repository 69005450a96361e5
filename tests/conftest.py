"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import socket

import pytest


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
        y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(samples, 1, generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)

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
