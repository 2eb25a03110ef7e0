"""What an executed lesson must look like to a reader, checked on papermill's executed copy.

- A figure that cannot vary is one number: no output prints a range whose ends are equal
  ("3.4 (3.4-3.4)").
- A conclusion is one short sentence (at most 30 words) with at most two figures; the rest
  belongs in a table.
- Every conclusion a student reads comes from a `conclude(...)` call written in the cell that
  shows it (a verdict function returns; it never states a conclusion itself).
"""

from __future__ import annotations

import json
import re

from pipelab.display import CONCLUSION_MIME

MAX_WORDS = 30
MAX_FIGURES = 2

# "3.4 (3.4-3.4)", "0.207 (0.207-0.207)", "12 ms (12-12)": the same number three times
EQUAL_RANGE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s*(?:[^\s()\d]{1,4}\s*)?\(\s*\1\s*[-–]\s*\1\s*\)")
# a figure: a number with a decimal point, a percentage, or of two digits or more ("rank 0",
# "2 ranks" and "1F1B" are names and counts, not figures)
FIGURE = re.compile(r"(?<![\w.,-])(?:\d+\.\d+|\d+\s?%|\d{1,3}(?:,\d{3})+|\d{2,})(?![\w])")
SENTENCE_END = re.compile(r"[.;!?]\s+(?=[A-Z])")


def _texts(output: dict) -> list[str]:
    if "text" in output:
        text = output["text"]
        return ["".join(text) if isinstance(text, list) else text]
    out = []
    for mime in ("text/plain", "text/markdown", "text/html"):
        value = output.get("data", {}).get(mime)
        if value is not None:
            out.append("".join(value) if isinstance(value, list) else value)
    return out


def equal_ranges(notebook: dict) -> list[str]:
    """Every place an output prints a range whose ends are equal, as 'cell N: ...'."""
    found = []
    for n, cell in enumerate(notebook.get("cells", [])):
        for output in cell.get("outputs", []):
            for text in _texts(output):
                for m in EQUAL_RANGE.finditer(text):
                    found.append(f"cell {n}: {text[max(0, m.start() - 40):m.end() + 10]!r}")
    return found


def conclusion_problems(notebook: dict) -> list[str]:
    """Conclusions too long, with too many figures, or not called in the cell that shows them."""
    problems = []
    for n, cell in enumerate(notebook.get("cells", [])):
        source = "".join(cell.get("source", []))
        for output in cell.get("outputs", []):
            value = output.get("data", {}).get(CONCLUSION_MIME)
            if value is None:
                continue
            text = (json.loads(value) if isinstance(value, str) else value)["text"]
            words, figures = len(text.split()), FIGURE.findall(text)
            if "conclude(" not in source:
                problems.append(f"cell {n}: a conclusion the cell does not call conclude() for: {text!r}")
            if words > MAX_WORDS:
                problems.append(f"cell {n}: {words} words (at most {MAX_WORDS}): {text!r}")
            if len(figures) > MAX_FIGURES:
                problems.append(f"cell {n}: {len(figures)} figures {figures} (at most {MAX_FIGURES}): {text!r}")
            if SENTENCE_END.search(text.strip()):
                problems.append(f"cell {n}: more than one sentence: {text!r}")
    return problems


def reader_problems(path: str) -> list[str]:
    """Everything above, for the executed notebook at `path`."""
    with open(path) as f:
        notebook = json.load(f)
    return [f"equal-ended range, {p}" for p in equal_ranges(notebook)] + conclusion_problems(notebook)


if __name__ == "__main__":  # python tests/notebook_checks.py build/06_gpipe.ipynb ...
    import sys

    for path in sys.argv[1:]:
        for problem in reader_problems(path):
            print(f"{path}: {problem}")
