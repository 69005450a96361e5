"""The transport seam: one interface, two engines (embedded, Kafka)."""

from spikeguard.bus.base import Bus, Consumer, Producer, Record, TopicPartition
from spikeguard.bus.embedded import EmbeddedBus

__all__ = ["Bus", "Consumer", "EmbeddedBus", "Producer", "Record", "TopicPartition"]
