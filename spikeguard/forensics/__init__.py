"""Spike forensics: after an incident, where in the model it started (``layers``)."""

from spikeguard.forensics.layers import LayerMove, attribute

__all__ = ["LayerMove", "attribute"]
