"""The import graph: no circles between modules or packages, and layers that only point down.

Every import counts: at module level, inside a function (a lazy import hides a
circle, it does not remove it) and under ``if TYPE_CHECKING:`` (the modules
still depend on each other). The graph is read from the source with ``ast``,
so nothing is imported. Edges go to the module named (``from pkg import mod``
is ``pkg.mod``; ``from pkg.mod import name`` is ``pkg.mod``), not to the
parent packages Python initialises on the way.

The layers are docs/design.md's ("Layers"), and :data:`LAYERS` is that table.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
#: top-level folder -> its import name (pyproject.toml's package-dir)
FOLDERS = {
    "spikeguard": "spikeguard",
    "producers": "spikeguard.producers",
    "processors": "spikeguard.processors",
    "actuators": "spikeguard.actuators",
    "schemas": "spikeguard.schemas",
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports, anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(
                    parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
                )
            targets.update(owner(f"{base}.{alias.name}") for alias in node.names)
    return {t for t in targets if t is not None and t != module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """Each module -> the package's modules it imports (read once: ~1 s of parsing)."""
    known = modules()
    return {m: imported(m, p, known) for m, p in known.items()}


def package_circles() -> list[list[str]]:
    return circles(module_graph())


def test_the_graph_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_anywhere():
    assert package_circles() == []


# -- layers ---------------------------------------------------------------------------------

#: Bottom to top, as docs/design.md's table lists them. A unit is a package or a module, with
#: every module under it; a module belongs to the longest unit that names it, so streaming/
#: spans two layers: the stage interface the pure stages implement, and the worker loop that
#: runs them on a bus. ``spikeguard`` is the package's own ``__init__`` (its public names).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors", ("spikeguard.errors",)),
    ("schemas", ("spikeguard.schemas",)),
    (
        "stage interface",
        (
            "spikeguard.streaming.stage",
            "spikeguard.streaming.run_clock",
            "spikeguard.streaming.run_sessions",
            "spikeguard.streaming.run_settings_stage",
        ),
    ),
    ("pure stages", ("spikeguard.processors", "spikeguard.actuators", "spikeguard.forensics")),
    ("transport", ("spikeguard.bus", "spikeguard.metrics", "spikeguard.deadletters")),
    (
        "trainer and worker loop",
        ("spikeguard.producers", "spikeguard.streaming", "spikeguard.alerting"),
    ),
    (
        "assembly",
        (
            "spikeguard.settings_sources",
            "spikeguard.settings",
            "spikeguard.trust",
            "spikeguard.components",
            "spikeguard.pipeline_watch",
            "spikeguard.metrics_http",
        ),
    ),
    (
        "offline tools and integrations",
        ("spikeguard.reporting", "spikeguard.lab", "spikeguard.integrations"),
    ),
    ("runtime", ("spikeguard.runtime",)),
    ("entry points", ("spikeguard", "spikeguard.cli", "spikeguard.demo", "spikeguard.__main__")),
)

#: Imports between two units of one layer: only these, each for its reason.
SIDEWAYS: dict[tuple[str, str], str] = {
    ("spikeguard.actuators", "spikeguard.processors"): "the policy knows which anomaly types "
    "fusion always calls critical (processors.decision_table), and measures a spread with the "
    "pipeline's constant (processors.robust_stats)",
    ("spikeguard.forensics", "spikeguard.processors"): "incident records measure with the "
    "pipeline's robust statistics (processors.robust_stats)",
    ("spikeguard.deadletters", "spikeguard.bus"): "a dead letter is a record of the bus",
    ("spikeguard.settings", "spikeguard.settings_sources"): "settings are read from files and "
    "the environment",
    ("spikeguard.trust", "spikeguard.settings"): "the signing keys are settings",
    ("spikeguard.components", "spikeguard.settings"): "each component is built from its settings",
    ("spikeguard.pipeline_watch", "spikeguard.components"): "the watch knows the pipeline's "
    "components by name",
    ("spikeguard.cli", "spikeguard"): "--version",
    ("spikeguard.cli", "spikeguard.demo"): "`spikeguard demo` runs the demo",
    ("spikeguard.__main__", "spikeguard.cli"): "`python -m spikeguard` is the CLI",
}

#: Imports that point up, each with why it is still there (none today: producers/ reaches the
#: runtime and the loggers through producers/wiring.py). An entry no longer needed fails below.
UPWARD_FOR_NOW: dict[tuple[str, str], str] = {}


def unit_of(module: str, units: list[str]) -> str | None:
    """The longest unit naming ``module``; the root package names itself only."""
    named = [u for u in units if module == u or (u != "spikeguard" and module.startswith(u + "."))]
    return max(named, key=len) if named else None


def package_of(module: str) -> str:
    """``spikeguard.X`` for any module under it (``X`` a package or a module)."""
    return ".".join(module.split(".")[:2])


def module_edges() -> set[tuple[str, str]]:
    return {(m, t) for m, targets in module_graph().items() for t in targets}


def layer_breaches(
    edges: set[tuple[str, str]],
    layers=LAYERS,
    sideways=SIDEWAYS,
    upward=UPWARD_FOR_NOW,
) -> list[str]:
    """Every import that points up a layer, or sideways without a reason; every unplaced module."""
    rank = {unit: i for i, (_, units) in enumerate(layers) for unit in units}
    units = list(rank)
    found = set()
    for source, target in edges:
        a, b = unit_of(source, units), unit_of(target, units)
        if a is None or b is None:
            found.add(f"{source if a is None else target} is in no layer")
        elif a == b or (a, b) in sideways or (a, b) in upward:
            continue
        elif rank[b] > rank[a]:
            found.add(f"{source} -> {target}: up from {layers[rank[a]][0]} to {layers[rank[b]][0]}")
        # One package's units of one layer may use each other (streaming's stage interface).
        elif rank[b] == rank[a] and package_of(source) != package_of(target):
            found.add(f"{source} -> {target}: sideways in {layers[rank[a]][0]}, with no reason")
    return sorted(found)


def package_graph(edges: set[tuple[str, str]], leave_out=UPWARD_FOR_NOW) -> dict[str, set[str]]:
    units = [u for _, us in LAYERS for u in us]
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        a, b = package_of(source), package_of(target)
        graph.setdefault(b, set())  # a node even if it imports nothing
        if a != b and (unit_of(source, units), unit_of(target, units)) not in leave_out:
            graph[a].add(b)
    return dict(graph)


def test_the_layers_see_an_import_that_points_up():
    layers = (("low", ("spikeguard.a",)), ("high", ("spikeguard.b", "spikeguard.c")))
    up = {("spikeguard.a.x", "spikeguard.b")}
    assert layer_breaches(up, layers, {}, {}) == [
        "spikeguard.a.x -> spikeguard.b: up from low to high"
    ]
    across = {("spikeguard.b", "spikeguard.c.y")}
    assert layer_breaches(across, layers, {}, {}) == [
        "spikeguard.b -> spikeguard.c.y: sideways in high, with no reason"
    ]
    assert layer_breaches(across, layers, {("spikeguard.b", "spikeguard.c"): "why"}, {}) == []
    assert layer_breaches({("spikeguard.b", "spikeguard.a.x")}, layers, {}, {}) == []
    assert layer_breaches({("spikeguard.d", "spikeguard.a")}, layers, {}, {}) == [
        "spikeguard.d is in no layer"
    ]


def test_a_cycle_between_packages_is_one_between_their_modules():
    edges = {("spikeguard.a.x", "spikeguard.b.y"), ("spikeguard.b.z", "spikeguard.a")}
    assert circles(package_graph(edges, leave_out={})) == [["spikeguard.a", "spikeguard.b"]]
    assert circles(package_graph({("spikeguard.a.x", "spikeguard.b.y")}, leave_out={})) == []


def test_layers_only_point_down():
    assert layer_breaches(module_edges()) == []


def test_no_import_cycle_between_packages():
    assert circles(package_graph(module_edges())) == []


def test_every_allowance_is_still_needed():
    """An entry no import needs any more goes (UPWARD_FOR_NOW's, once the Guard's parts move)."""
    units = [u for _, us in LAYERS for u in us]
    edges = {(unit_of(a, units), unit_of(b, units)) for a, b in module_edges()}
    assert [pair for pair in UPWARD_FOR_NOW if pair not in edges] == []
    assert [pair for pair in SIDEWAYS if pair not in edges] == []


def test_the_design_doc_lists_the_layers_of_this_test():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    documented = [
        (cells[2], tuple(re.findall(r"`([\w.]+)`", cells[3])))
        for cells in (row.split("|") for row in rows)
    ]
    documented = [(name.strip(), units) for name, units in documented]
    assert documented == [(name, units) for name, units in LAYERS]
