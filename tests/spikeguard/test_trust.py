"""Who may steer a run: a key is required on Kafka, made per process when embedded."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.schemas import Action, ActionKind
from spikeguard.settings import load_settings
from spikeguard.trust import MissingSigningKey, ensure_signing_key

KAFKA = {"SPIKEGUARD_BOOTSTRAP_SERVERS": "broker.invalid:9092"}


def test_kafka_without_a_key_refuses_and_says_how_to_fix_it():
    with pytest.raises(MissingSigningKey) as caught:
        ensure_signing_key(load_settings(env=KAFKA), "the actuator worker")
    text = str(caught.value)
    assert "the actuator worker" in text and "SPIKEGUARD_SIGNING_KEY" in text
    assert "--insecure" in text and "SPIKEGUARD_INSECURE=1" in text


def test_an_empty_key_is_no_key():
    settings = load_settings(env={**KAFKA, "SPIKEGUARD_SIGNING_KEY": ""})
    assert settings.signing_key is None
    with pytest.raises(MissingSigningKey):
        ensure_signing_key(settings, "the trainer's guard")


def test_the_explicit_opt_out_is_one_loud_warning(caplog):
    settings = load_settings(env={**KAFKA, "SPIKEGUARD_INSECURE": "1"})
    with caplog.at_level(logging.WARNING, logger="spikeguard.trust"):
        kept = ensure_signing_key(settings, "the trainer's guard")
    assert kept.signing_key is None
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "INSECURE" in lines[0].getMessage()
    assert "the trainer's guard" in lines[0].getMessage()


def test_a_given_key_is_kept_and_never_shown():
    settings = load_settings(env={**KAFKA, "SPIKEGUARD_SIGNING_KEY": "s3cret-k3y"})
    kept = ensure_signing_key(settings, "x")
    assert kept.signing_key.get_secret_value() == "s3cret-k3y"
    assert "s3cret-k3y" not in repr(kept)


def test_embedded_makes_a_random_key_per_process():
    one = ensure_signing_key(load_settings(env={}), "x").signing_key
    two = ensure_signing_key(load_settings(env={}), "x").signing_key
    assert one is not None and two is not None
    assert one.get_secret_value() != two.get_secret_value()
    assert len(one.get_secret_value()) >= 32


@pytest.mark.pipeline
def test_embedded_guard_refuses_an_unsigned_stop_and_obeys_its_own_pipeline(
    tmp_path, monkeypatch, caplog
):
    """Guard(connect=True) on the embedded bus: the in-process actuator's key is the guard's."""
    for name in ("SPIKEGUARD_BOOTSTRAP_SERVERS", "SPIKEGUARD_SIGNING_KEY", "SPIKEGUARD_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model,
        optimizer,
        run_id="trust-embedded",
        config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False),
    )
    try:
        assert guard.signer.key is not None and guard.actions.signer is guard.signer
        assert guard.signer.key == guard.own_runtime.settings.signing_key
        forged = Action(
            action_id="forged-stop",
            run_id="trust-embedded",
            kind=ActionKind.STOP,
            apply_at_step=0,
            params={"reason": "someone else"},
        )
        producer = guard.bus.producer()
        producer.publish(
            guard.topics.actions, forged.model_dump_json().encode(), key="trust-embedded"
        )
        producer.flush()
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.WARNING, logger="spikeguard.producers.actions"):
            while not any(a["action_id"] == "forged-stop" for a in guard.applied):
                assert time.monotonic() < deadline, "the forged action never reached the guard"
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                guard.step(torch.nn.functional.mse_loss(model(x), y).detach())
                time.sleep(0.01)
        [answer] = [a for a in guard.applied if a["action_id"] == "forged-stop"]
        assert answer["status"] == "rejected" and "unsigned" in answer["result"]
        assert not guard.should_stop
        assert any("refused stop action forged-stop" in r.getMessage() for r in caplog.records)
    finally:
        guard.close()
