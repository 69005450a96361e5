"""Fixtures of the integration tests: a bare embedded bus, one thread, the helpers importable."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from spikeguard.bus import EmbeddedBus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def bus():
    bus = EmbeddedBus()
    yield bus
    bus.close()
