"""Fixtures of the producers tests (helpers live in producers_helpers.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import Topics


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def bus():
    bus = EmbeddedBus()
    yield bus
    bus.close()


@pytest.fixture
def topics():
    return Topics()


# The helpers module sits beside this file; make it importable however pytest was started.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
