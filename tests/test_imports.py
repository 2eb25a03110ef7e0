"""Arrows point down: the import contracts in pyproject.toml ([tool.importlinter]) hold.

`lint-imports` reads every import of the package (those inside functions too) and fails on one
that points up a layer, ties two parts that stand apart, or brings the emulator into an
algorithm a student reads."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    tool = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(tool).exists():
        pytest.skip("import-linter is not installed: pip install -e '.[dev]'")
    done = subprocess.run([tool, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
