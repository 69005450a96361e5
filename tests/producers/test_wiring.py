"""producers/ sits below the runtime and the integrations: it reaches them only through a seam.

The runtime a Guard opens when it is handed none, and its action loggers, come
through producers/wiring.py's WIRING, which the package's root fills on its
first import; no module of producers/ imports a package above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from producers_helpers import Tiny

import spikeguard
from spikeguard.producers import wiring
from spikeguard.producers.guard import Guard
from spikeguard.producers.config import GuardConfig

PRODUCERS = Path(__file__).resolve().parents[2] / "producers"
#: What producers/ may not import: the layers above it (DESIGN.md, "Layers point down").
ABOVE = ("spikeguard.runtime", "spikeguard.integrations", "spikeguard.settings", "spikeguard.cli")
ABOVE += ("spikeguard.demo", "spikeguard.lab", "spikeguard.reporting", "spikeguard.alerting")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):  # lazy and TYPE_CHECKING imports too
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_module_of_producers_imports_a_layer_above_it():
    found = {
        f"{path.relative_to(PRODUCERS)} -> {name}"
        for path in PRODUCERS.rglob("*.py")
        for name in _imports(path)
        if name == "spikeguard" or name.startswith(ABOVE)
    }
    assert found == set()


def test_the_package_root_fills_the_seam_on_its_first_import():
    assert spikeguard.__name__ == "spikeguard"
    assert wiring.WIRING.open_runtime is not None and wiring.WIRING.loggers is not None


class _Runtime:
    """A runtime without a bus (as a broker that cannot be reached leaves one)."""

    def __init__(self) -> None:
        self.bus, self.topics, self.settings, self.closed = None, None, None, False

    def close(self) -> None:
        self.closed = True


def test_a_guard_handed_no_runtime_opens_the_wired_one_and_closes_it(tmp_path, monkeypatch):
    opened: list[_Runtime] = []

    def open_runtime() -> _Runtime:
        opened.append(_Runtime())
        return opened[-1]

    monkeypatch.setattr(wiring.WIRING, "open_runtime", open_runtime)
    tiny = Tiny()
    config = GuardConfig(checkpoint_dir=str(tmp_path), resume=False)
    guard = Guard(tiny.model, tiny.optimizer, run_id="r1", config=config)
    assert len(opened) == 1 and guard.own_runtime is opened[0] and guard.bus is None
    guard.close()
    assert opened[0].closed
    own_dir = GuardConfig(checkpoint_dir=str(tmp_path / "r2"), resume=False)  # (r1's is r1's)
    unconnected = Guard(tiny.model, tiny.optimizer, run_id="r2", config=own_dir, connect=False)
    assert len(opened) == 1 and unconnected.own_runtime is None
    unconnected.close()
