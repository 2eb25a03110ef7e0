"""Every lesson notebook executes with papermill (defaults of its `parameters` cell, the exercises'
reference solutions loaded) without error.

New notebooks under notebooks/ are picked up automatically."""

import glob
import json
import os

import pytest

from pipelab.cli import run_notebook

from notebook_checks import reader_problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_is_committed_clean(path):
    cells = json.load(open(path))["cells"]
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert not any(c.get("outputs") for c in cells if c["cell_type"] == "code"), "clear the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    # With the reference solutions loaded, as CI runs the course: every exercise can be solved and
    # its checker passes the solution (the notebook asserts it).
    run = run_notebook(path, str(tmp_path), {"solutions": True})
    assert run.status == "ok", f"{run.notebook} failed: {run.error} (executed copy in {tmp_path})"
    assert run.headline is not None, "the notebook must report its headline with pipelab.headline()"
    problems = reader_problems(os.path.join(str(tmp_path), os.path.basename(path)))
    assert not problems, "what a reader would trip over:\n" + "\n".join(problems)
