"""The pipeline's components built from settings (spikeguard/components.py)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from spikeguard.components import COMPONENTS, DETECTOR_NAMES, build_stage, detector_stage
from spikeguard.schemas import Topics
from spikeguard.schemas.signing import Keyring
from spikeguard.settings import Settings


@pytest.mark.parametrize("name", DETECTOR_NAMES)
def test_a_detector_stage_takes_its_gaps_and_detector_from_settings(name: str) -> None:
    settings = Settings.model_validate({"worker": {"max_step_gap": 123, "max_epoch_gap": 7}})
    stage = detector_stage(name, settings, Topics("t."))
    assert (stage.name, stage.max_step_gap, stage.max_epoch_gap) == (name, 123, 7)
    detector = stage.factory("run")
    assert type(detector).__name__.lower().startswith(name)
    assert detector.config == getattr(settings, name)


def test_an_unknown_detector_is_named() -> None:
    with pytest.raises(ValueError, match="unknown detector 'fusion'"):
        detector_stage("fusion", Settings(), Topics())


@pytest.mark.parametrize("name", COMPONENTS)
def test_every_stage_gets_the_keyring_of_role_keys(name: str) -> None:
    settings = Settings(signing_key=SecretStr("shared"), actuator_key=SecretStr("actuator"))
    stage = build_stage(name, settings)
    assert isinstance(stage.signing_key, Keyring)
    assert stage.signing_key == settings.keys()
