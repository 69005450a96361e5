"""spikeguard keeps PyTorch training runs alive through loss spikes.

    from spikeguard import Guard
    guard = Guard(model, optimizer, scheduler, run_id="my-run", mode="observe")

The names a user touches are here: ``Guard`` and ``GuardConfig`` for a plain
loop, ``HFCallback`` and ``LightningCallback`` for HF Trainer and Lightning,
``InspectSetup`` for ``spikeguard inspect --setup``. Each loads on first use,
so ``import spikeguard`` needs neither torch nor any framework (the workers
import this package and never install them).
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Sequence

from spikeguard.producers import wiring as _wiring

try:
    __version__ = version("spikeguard")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

#: public name -> (module, attribute there)
_LAZY = {
    "Guard": ("spikeguard.producers.guard", "Guard"),
    "GuardConfig": ("spikeguard.producers.config", "GuardConfig"),
    "HFCallback": ("spikeguard.integrations.hf", "SpikeguardCallback"),
    "LightningCallback": ("spikeguard.integrations.lightning", "SpikeguardCallback"),
    "InspectSetup": ("spikeguard.forensics.inspect", "InspectSetup"),
}

__all__ = ["Guard", "GuardConfig", "HFCallback", "InspectSetup", "LightningCallback", "__version__"]

if TYPE_CHECKING:
    from spikeguard.forensics.inspect import InspectSetup
    from spikeguard.integrations.hf import SpikeguardCallback as HFCallback
    from spikeguard.integrations.lightning import SpikeguardCallback as LightningCallback
    from spikeguard.producers.config import GuardConfig
    from spikeguard.producers.guard import Guard


def _open_runtime() -> Any:
    from spikeguard.runtime import open_runtime  # the embedded pipeline, or Kafka

    return open_runtime()


def _action_loggers(names: Sequence[str]) -> list[Any]:
    from spikeguard.integrations.loggers import loggers_from  # TensorBoard, W&B when installed

    return loggers_from(names)


# What a Guard handed no runtime opens, and its loggers: producers/ sits below the runtime and
# the integrations and never imports them (producers/wiring.py). Filled here, the package's
# first import, so before any Guard is built; importing the seam costs nothing.
_wiring.WIRING.open_runtime, _wiring.WIRING.loggers = _open_runtime, _action_loggers


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(import_module(module), attribute)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'spikeguard' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
