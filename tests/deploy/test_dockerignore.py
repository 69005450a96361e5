"""The image's build context holds what the Dockerfile copies, and nothing else."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rules() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copied() -> set[str]:
    sources = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(word.startswith("--from") for word in words):
            sources.update(word.rstrip("/") for word in words[1:-1])
    return sources


def test_the_context_starts_empty_and_admits_exactly_what_the_dockerfile_copies():
    rules = _rules()
    assert rules[0] == "*"
    admitted = {rule[1:] for rule in rules if rule.startswith("!")}
    assert admitted == _copied()
    assert {"spikeguard", "schemas", "producers", "processors", "actuators", "pyproject.toml"} <= admitted


def test_bytecode_stays_out_even_inside_admitted_folders():
    rules = _rules()
    assert rules.index("**/__pycache__") > max(i for i, rule in enumerate(rules) if rule.startswith("!"))
