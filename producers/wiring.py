"""The seam through which the layer above producers/ gives a Guard its pipeline and loggers.

The runtime (the embedded pipeline, or Kafka: spikeguard/runtime/) and the
action loggers (TensorBoard, W&B: spikeguard/integrations/loggers.py) live
above producers/, which never imports them. A Guard sees a runtime only as a
:class:`PipelineRuntime`; when it is handed none it opens the one
:data:`WIRING` names, which ``spikeguard/__init__.py`` fills when the package
is first imported (so before any Guard is built). Importing this module costs
nothing: the workers import the package and never build a Guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

if TYPE_CHECKING:
    from spikeguard.bus import Bus
    from spikeguard.producers.config import GuardConfig
    from spikeguard.producers.narration import ActionLogger
    from spikeguard.schemas import Topics
    from spikeguard.schemas.signing import SigningKey


class PipelineSettings(Protocol):
    """What a Guard reads of its runtime's settings (spikeguard.settings.Settings)."""

    guard: GuardConfig

    def keys(self) -> SigningKey | None: ...


class PipelineRuntime(Protocol):
    """What a Guard uses of a runtime (spikeguard.runtime.Runtime); ``bus`` None: unreachable."""

    @property
    def bus(self) -> Bus | None: ...

    @property
    def topics(self) -> Topics: ...

    @property
    def settings(self) -> PipelineSettings: ...

    def close(self) -> None: ...


@dataclass
class Wiring:
    """What the layer above producers/ provides."""

    #: Opens the default runtime for a Guard handed none (None: the Guard runs unconnected).
    open_runtime: Callable[[], PipelineRuntime] | None = None
    #: The action loggers ``GuardConfig.loggers`` names that can run here.
    loggers: Callable[[Sequence[str]], list[ActionLogger]] | None = None


#: Filled once, from above (spikeguard/__init__.py).
WIRING = Wiring()


def action_loggers(names: Sequence[str]) -> list[ActionLogger]:
    """The loggers ``names`` asks for, as the layer above makes them (none installed: none)."""
    return WIRING.loggers(names) if WIRING.loggers is not None else []
