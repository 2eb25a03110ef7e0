"""The README's commands work as typed, after the README's set-up.

The commands are read from README.md itself (its code blocks and `inline code`), so the command
tested is the command a reader types. Each runs in bash with the venv's bin/ first on PATH (what
`source .venv/bin/activate` does), from a scratch folder holding only a link to notebooks/, so
nothing is written into the repository. Left out: what needs the network or makes a venv (the
set-up one-liners, pip installs), `pipelab run` of the whole course, and the Slurm examples.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BIN = os.path.dirname(sys.executable)  # .venv/bin: the README's set-up runs the tests with .venv/bin/python

# What each README command must look like (the whole command), and what its output must show.
COMMANDS = {
    "pipelab doctor": (r"pipelab doctor", "torch"),
    "pipelab --version": (r"pipelab --version", "pipelab "),
    "pipelab profiles": (r"pipelab profiles", "00_workers_and_timelines"),
    "papermill example": (r"(mkdir -p build && )?papermill notebooks/00_\w+\.ipynb \S+\.ipynb( -p \w+ \S+)*",
                          "Executing"),
    "torchrun hello": (r"torchrun --nproc-per-node \d+ -m pipelab\.launch pipelab\.launch:hello",
                       "sum of ranks"),
}


def readme_commands(text: str) -> set[str]:
    """Every line of the README's code blocks (comments dropped) and every `inline code` span."""
    found, in_fence, in_indented, previous_blank = set(), False, False, True
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if line.strip():  # an indented block starts after a blank line and ends at a line that is not
            in_indented = line.startswith("    ") and (in_indented or previous_blank)
        if in_fence or in_indented:
            command = re.sub(r"(^|\s+)#(\s.*)?$", "", line).strip()  # shell comments
            if command:
                found.add(command)
        previous_blank = not line.strip()
    found.update(span.strip() for span in re.findall(r"`([^`\n]+)`", text))
    return found


def commands_like(pattern: str) -> list[str]:
    with open(README) as f:
        return sorted(c for c in readme_commands(f.read()) if re.fullmatch(pattern, c))


@pytest.fixture()
def scratch(tmp_path):
    """A folder to run commands in, with the course's notebooks/ linked in (read only)."""
    os.symlink(os.path.join(ROOT, "notebooks"), tmp_path / "notebooks")
    return tmp_path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_readme_command_works_as_typed(name, scratch):
    pattern, expected = COMMANDS[name]
    commands = commands_like(pattern)
    assert commands, f"the README no longer shows the {name} command (looked for /{pattern}/)"
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), VIRTUAL_ENV=os.path.dirname(BIN))
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=240, stdin=subprocess.DEVNULL)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"`{command}` exited with {done.returncode}:\n{output[-3000:]}"
        assert expected in output, f"`{command}` did not print {expected!r}:\n{output[-3000:]}"


def test_readme_tells_how_to_reach_the_venv_commands():
    with open(README) as f:
        text = f.read()
    assert "source .venv/bin/activate" in text
    assert "--allow-root" in text  # JupyterLab as root: every container


def test_ci_runs_the_readme_test_command_verbatim():
    with open(README) as f:
        setups = [c for c in readme_commands(f.read()) if c.startswith("python3 -m venv .venv") and "pytest" in c]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().splitlines()
    assert len(setups) == 1 and setups[0] in ci, f"README's test command {setups} is not a line of .ci/run"
