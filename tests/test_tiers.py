"""The rule in tests/conftest.py that sorts tests into the fast unit tier and the rest."""

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_only_tests_that_start_no_process_need_no_broker_and_are_not_marked_slow_are_unit(pytester):
    # The tier of each test, as its markers say (one collection, no run).
    pytester.makeconftest(
        CONFTEST.read_text()
        + """

def pytest_collection_finish(session):
    for item in session.items:
        names = {marker.name for marker in item.iter_markers()} & {"unit", *OUTSIDE_UNIT}
        print("tier", item.name, *sorted(names))
"""
    )
    pytester.makeini(
        "[pytest]\nmarkers =\n    unit: u\n    kafka: k\n    slow: s\n    pipeline: p\n    heavy: h\n"
    )
    pytester.makepyfile(
        test_sorted="""
        import subprocess
        import pytest

        @pytest.fixture
        def worker():
            return subprocess.Popen  # a fixture that starts a process

        def test_plain():
            assert 1 + 1 == 2

        def test_runs_a_child():
            subprocess.run(["true"])

        def test_through_a_fixture(worker):
            pass

        def test_on_the_broker(kafka_bootstrap):
            pass

        @pytest.mark.heavy
        def test_trains_for_seconds():
            pass

        @pytest.mark.slow
        def test_restarts_a_broker():
            pass
    """
    )

    result = pytester.runpytest("--collect-only", "-q")
    tiers = dict(line.split(" ", 2)[1:] for line in result.outlines if line.startswith("tier "))
    assert tiers == {
        "test_plain": "unit",
        "test_runs_a_child": "pipeline",
        "test_through_a_fixture": "pipeline",
        "test_on_the_broker": "kafka",
        "test_trains_for_seconds": "heavy",
        "test_restarts_a_broker": "slow",
    }


def test_a_slow_unit_test_is_named_at_the_end(pytester, monkeypatch):
    pytester.makeconftest(
        CONFTEST.read_text().replace("UNIT_BUDGET_S = 3.0", "UNIT_BUDGET_S = 0.0")
    )
    pytester.makeini(
        "[pytest]\nmarkers =\n    unit: u\n    kafka: k\n    slow: s\n    pipeline: p\n    heavy: h\n"
    )
    pytester.makepyfile(test_budget="def test_over_budget():\n    sum(range(10_000))\n")
    result = pytester.runpytest("-m", "unit")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*unit tests over 0 s (mark them heavy or pipeline)*", "*test_over_budget*"]
    )


def test_no_test_sleeps_a_fixed_time_to_wait_for_something():
    """A sleep outside a polling loop races on a loaded machine: wait on the condition instead
    (the ``wait_until`` fixture). A sleep that is the scenario itself says so on its line."""
    import ast

    fixed = []
    for path in sorted(CONFTEST.parent.rglob("*.py")):
        lines = path.read_text().splitlines()

        def visit(node: ast.AST, in_loop: bool, lines=lines, path=path) -> None:
            for child in ast.iter_child_nodes(node):
                if (
                    isinstance(child, ast.Call)
                    and isinstance(child.func, ast.Attribute)
                    and child.func.attr == "sleep"
                    and not in_loop
                    and "not a wait" not in lines[child.lineno - 1]
                ):
                    fixed.append(f"{path.relative_to(CONFTEST.parent)}:{child.lineno}")
                loops = (ast.While, ast.For, ast.AsyncFor)
                functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
                visit(
                    child,
                    False if isinstance(child, functions) else in_loop or isinstance(child, loops),
                )

        visit(ast.parse(path.read_text()), False)
    assert fixed == []
