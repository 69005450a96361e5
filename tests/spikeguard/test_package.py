"""What a user touches first: the top-level imports and ``spikeguard --version``.

Each check runs in a fresh interpreter, so what ``import spikeguard`` pulls in
is measured from nothing, not from what other tests already imported.
"""

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

PYTHON = os.environ.get("SPIKEGUARD_PYTHON", sys.executable)


def _run(code: str) -> str:
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_spikeguard_needs_no_framework_and_no_torch():
    loaded = json.loads(
        _run(
            "import json, sys, spikeguard\n"
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'lightning') if m in sys.modules)))"
        )
    )
    assert loaded == []


def test_guard_and_its_config_import_from_the_top_level():
    out = _run(
        "from spikeguard import Guard, GuardConfig\n"
        "from spikeguard.producers.guard import Guard as G\n"
        "from spikeguard.producers.config import GuardConfig as C\n"
        "print(Guard is G, GuardConfig is C, GuardConfig().checkpoint_every)"
    )
    assert out.split() == ["True", "True", "50"]


def test_guard_config_alone_does_not_import_torch():
    # The workers read GuardConfig through the settings and must stay torch-free.
    out = _run("import sys\nfrom spikeguard import GuardConfig\nprint('torch' in sys.modules)")
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "name, module",
    [
        ("HFCallback", "spikeguard.integrations.hf"),
        ("LightningCallback", "spikeguard.integrations.lightning"),
    ],
)
def test_framework_callbacks_load_on_first_use(name, module):
    out = _run(
        "import sys, importlib, spikeguard\n"
        f"before = {module!r} in sys.modules\n"
        f"cls = getattr(spikeguard, {name!r})\n"
        f"print(before, cls is importlib.import_module({module!r}).SpikeguardCallback)"
    )
    assert out.split() == ["False", "True"]


def test_inspect_setup_imports_from_the_top_level():
    out = _run(
        "from spikeguard import InspectSetup\n"
        "from spikeguard.forensics.inspect import InspectSetup as I\n"
        "print(InspectSetup is I)"
    )
    assert out.strip() == "True"


def test_an_unknown_name_says_which():
    out = _run(
        "import spikeguard\ntry:\n    spikeguard.Gaurd\nexcept AttributeError as e:\n    print(e)"
    )
    assert "Gaurd" in out


def test_the_public_names_are_listed():
    out = _run(
        "import spikeguard\nprint(sorted(spikeguard.__all__)); print('Guard' in dir(spikeguard))"
    )
    names, in_dir = out.splitlines()
    for name in (
        "Guard",
        "GuardConfig",
        "HFCallback",
        "LightningCallback",
        "InspectSetup",
        "__version__",
    ):
        assert name in names
    assert in_dir == "True"


def test_version_comes_from_the_installed_package():
    assert _run("import spikeguard\nprint(spikeguard.__version__)").strip() == version("spikeguard")


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "spikeguard", "--version"],
        ["-c", "import sys; from spikeguard.cli import main; sys.exit(main(['--version']))"],
    ],
)
def test_spikeguard_version(command):
    done = subprocess.run([PYTHON, *command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"spikeguard {version('spikeguard')}"


def test_a_backtest_without_the_forest_does_not_import_scikit_learn():
    # scikit-learn (and scipy under it) cost ~1.5 s of CPU to import: most of a short
    # backtest's time, for a forest that is off by default.
    loaded = json.loads(
        _run(
            "import json, sys\n"
            "from spikeguard.lab.backtest import backtest_events\n"
            "from spikeguard.lab.simulate import generate\n"
            "decisions = backtest_events(generate('sudden_spike', 1000, 0).events)\n"
            "assert any(d.is_anomaly for d in decisions)\n"
            "print(json.dumps(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules)))"
        )
    )
    assert loaded == []
