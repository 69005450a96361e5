"""The instability lab: published causes of loss spikes, reproduced in a small transformer.

Each mechanism (:mod:`.mechanisms`) is a recipe that breaks training and a
healthy twin with the fix on; :func:`.train.train` runs one, seeded, with the
mechanism signals of :mod:`spikeguard.producers.signals` on every step and
optional responses (:mod:`.responses`); :mod:`.labels` is the written label
rule and writes runs as run files; :mod:`.warning` times the signals against
the loss alarm. benchmarks/bench_instability.py and docs/instability.md hold
the figures.
"""

from spikeguard.lab.instability.mechanisms import HEALTHY, MECHANISMS, Mechanism
from spikeguard.lab.instability.responses import LRCut, QKClip, ZLossOn
from spikeguard.lab.instability.train import LabRun, Recipe, train

__all__ = [
    "HEALTHY",
    "MECHANISMS",
    "LRCut",
    "LabRun",
    "Mechanism",
    "QKClip",
    "Recipe",
    "ZLossOn",
    "train",
]
