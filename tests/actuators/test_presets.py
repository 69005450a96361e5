"""Model profiles and the ``spikeguard presets`` command."""

from __future__ import annotations

import argparse
import json

import pytest

from spikeguard.actuators import PRESETS, PolicyConfig, get_preset
from spikeguard.cli import presets as presets_cli
from spikeguard.errors import ConfigError


def test_three_profiles_with_valid_policies() -> None:
    assert list(PRESETS) == ["small", "medium", "large"]
    for preset in PRESETS.values():
        assert isinstance(preset.policy_config(), PolicyConfig)


def test_a_preset_holds_only_values_the_code_uses() -> None:
    # checkpoint_interval_steps is the Guard's checkpoint_every (run_plan.py); the policy
    # becomes the PolicyConfig. An LR, clip or warm-up here would be shown and never used.
    assert set(get_preset("small").model_dump()) == {
        "name",
        "description",
        "checkpoint_interval_steps",
        "policy",
    }


def test_medium_is_the_default_policy() -> None:
    assert get_preset("medium").policy_config() == PolicyConfig()


def test_larger_models_are_more_cautious() -> None:
    small, medium, large = (get_preset(n) for n in ("small", "medium", "large"))
    assert (
        small.checkpoint_interval_steps
        > medium.checkpoint_interval_steps
        > large.checkpoint_interval_steps
    )
    s, m, lg = (p.policy_config() for p in (small, medium, large))
    assert s.lr_restore_healthy_steps < m.lr_restore_healthy_steps < lg.lr_restore_healthy_steps
    assert s.skip_extra_batches < m.skip_extra_batches < lg.skip_extra_batches
    assert s.spike_patience_steps <= m.spike_patience_steps <= lg.spike_patience_steps
    assert (
        lg.lr_decrease_factor_explosion
        <= m.lr_decrease_factor_explosion
        <= s.lr_decrease_factor_explosion
    )


def test_overrides_and_unknown_names() -> None:
    cfg = get_preset("large").policy_config(spike_patience_steps=9)
    assert cfg.spike_patience_steps == 9 and cfg.skip_extra_batches == 8
    with pytest.raises(ConfigError, match="huge"):
        get_preset("huge")


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> str:
    parser = argparse.ArgumentParser()
    presets_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["presets", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_cli_table(capsys: pytest.CaptureFixture) -> None:
    out = _cli(capsys)
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["name", "ckpt", "every"]
    assert [line.split()[0] for line in lines[1:4]] == ["small", "medium", "large"]


def test_cli_one_profile(capsys: pytest.CaptureFixture) -> None:
    out = _cli(capsys, "large")
    assert (
        out.startswith("large:")
        and "rollback_min_steps_before_onset" in out
        and "learning_rate" not in out
    )


def test_cli_json(capsys: pytest.CaptureFixture) -> None:
    everything = json.loads(_cli(capsys, "--json"))
    assert set(everything) == {"small", "medium", "large"}
    one = json.loads(_cli(capsys, "small", "--json"))
    assert one == everything["small"]
    assert PolicyConfig(**one["policy"]) == get_preset("small").policy_config()


def test_cli_rejects_unknown_profile(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    presets_cli.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["presets", "huge"])
