"""Robust figures (`measure.Measured`, `compare`, `ratios`, `alternate`), conclusions a notebook
states (`pipelab.conclude`), and how repeated course runs are compared (`batch.conclusion_changes`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelab import cli
from pipelab.batch import conclusion_changes, headline_spread
from pipelab.measure import Measured, alternate, compare, compare_medians, ratios
from test_cli import write_notebook

ROOT = Path(__file__).resolve().parents[1]


def test_measured_reports_median_and_range():
    m = Measured.of([3.0, 1.0, 2.0, 10.0])
    assert (m.median, m.low, m.high) == (2.5, 1.0, 10.0)
    assert m.relative_spread == pytest.approx(9.0 / 2.5)
    assert f"{m:.1f}" == "2.5 (1.0-10.0)"
    assert f"{Measured.of([4.0]):.2f}" == "4.00"  # one repeat has no range to show
    assert m.scaled(1000).median == 2500.0


def test_measured_needs_a_value():
    with pytest.raises(ValueError, match="at least one value"):
        Measured.of([])


def test_compare_claims_a_direction_only_when_ranges_do_not_overlap():
    fast, slow = Measured.of([1.0, 1.1, 1.2]), Measured.of([1.3, 1.5])
    assert compare(fast, slow) == "lower" and compare(slow, fast) == "higher"
    overlapping = Measured.of([1.15, 1.6])
    assert compare(fast, overlapping) == "within noise" == compare(overlapping, slow)


def test_compare_medians_needs_a_difference_beyond_the_margin():
    typical_low = Measured.of([0.12, 0.16, 0.28])  # one disturbed step overlaps the other's range
    other = Measured.of([0.25, 0.26, 0.30])
    assert compare(typical_low, other) == "within noise"
    assert compare_medians(typical_low, other) == "lower" and compare_medians(other, typical_low) == "higher"
    near = Measured.of([0.22])
    assert compare_medians(near, other) == "within noise"  # 15 % apart: less than run-to-run noise
    assert compare_medians(near, other, margin=0.1) == "lower"


def test_ratios_are_taken_round_by_round():
    r = ratios([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])
    assert r.values == (2.0, 2.0, 3.0) and r.median == 2.0
    with pytest.raises(ValueError, match="as many repeats"):
        ratios([1.0], [1.0, 2.0])


def test_alternate_calls_the_runs_in_turn():
    calls = []
    runs = {"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 2.0}
    figures = alternate(runs, repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4  # one warm-up round, then A B A B A B
    assert figures == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_a_notebook_conclusion_and_headline_spread_reach_summary_json(tmp_path, capsys):
    nb = write_notebook(tmp_path / "01_c.ipynb", [
        "x = 1",
        "import pipelab\nfrom pipelab.measure import Measured, compare\n"
        "a, b = Measured.of([1, 2, 3]), Measured.of([5, 6])\n"
        "pipelab.conclude('01.a_vs_b', compare(a, b), f'a ({a}) was {compare(a, b)} than b ({b})', a=a, b=b)\n"
        "pipelab.headline('a', a, 's')",
    ])
    assert cli.main(["run", nb, "--out", str(tmp_path / "build")]) == 0
    printed = capsys.readouterr().out
    assert "a = 2 s (1-3)" in printed  # the headline's spread shows in the table
    (row,) = json.loads((tmp_path / "build" / "summary.json").read_text())["notebooks"]
    (c,) = row["conclusions"]
    assert c["key"] == "01.a_vs_b" and c["verdict"] == "lower"
    assert c["text"] == "a (2 (1-3)) was lower than b (5.5 (5-6))"
    assert c["figures"]["a"] == {"median": 2.0, "low": 1.0, "high": 3.0}
    assert row["headline"]["low"] == 1.0 and row["headline"]["high"] == 3.0


def _row(notebook, *conclusions, value=1.0):
    return {"notebook": notebook, "status": "ok", "headline": {"name": "h", "unit": "x", "value": value},
            "conclusions": [{"key": k, "verdict": v, "text": f"{k} is {v}", "figures": {"f": v}}
                            for k, v in conclusions]}


def test_conclusion_changes_lists_flipped_and_missing_verdicts_only():
    runs = [[_row("06", ("bubble", "lower"), ("stash", "fits"), value=1.0)],
            [_row("06", ("bubble", "within noise"), ("stash", "fits"), value=3.0)],
            [_row("06", ("stash", "fits"), value=2.0)]]
    (change,) = conclusion_changes(runs)
    assert change["key"] == "bubble" and change["verdicts"] == ["lower", "within noise", None]
    assert change["texts"][0] == "bubble is lower" and change["figures"][2] is None
    assert conclusion_changes(runs[:1] * 3) == []
    h = headline_spread(runs)["06"]
    assert (h["median"], h["low"], h["high"], h["values"]) == (2.0, 1.0, 3.0, [1.0, 3.0, 2.0])


def test_conclusions_script_compares_runs_already_made(tmp_path):
    dirs = []
    for i, verdict in enumerate(["lower", "higher"]):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"notebooks": [_row("07", ("zb", verdict))]}))
        dirs.append(str(d))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "conclusions.py"), "--from", *dirs],
                         capture_output=True, text=True, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last["changed"] == 1 and last["changed_keys"] == ["07:zb"] and last["failed"] == []
    assert "zb is lower" in out and "zb is higher" in out
