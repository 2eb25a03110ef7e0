"""Does the course say the same thing every time it runs? Run every lesson several times and list
each printed conclusion whose verdict changed between runs, with the figures behind it.

    python benchmarks/conclusions.py [--runs 3] [--loaded-run K] [--out build/conclusions] [NOTEBOOK ...]
    python benchmarks/conclusions.py --from build/conclusions/run1 build/conclusions/run2 ...

Every sentence a lesson computes from a measurement goes through `pipelab.conclude(key, verdict,
text, **figures)`; `pipelab run` stores them in summary.json. A verdict that flips between runs is a
sentence the machine's noise can falsify. Not part of the test suite: it takes the whole course's
time, `--runs` times over. `--loaded-run K` runs the K-th run with two CPU-bound processes beside
it (a laptop compiling something, a shared JupyterHub): a verdict that only holds on a quiet machine
shows up as a change. The last line is a JSON object.
"""

import argparse
import json
import os
import contextlib
import subprocess
import sys

from pipelab.batch import conclusion_changes, headline_spread


def run_course(out: str, notebooks: list[str], extra: list[str]) -> str:
    """One `pipelab run` of the chosen lessons into `out`; returns its summary.json's path."""
    cmd = [sys.executable, "-m", "pipelab.cli", "run", "--out", out, *notebooks, *extra]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False)
    return os.path.join(out, "summary.json")


@contextlib.contextmanager
def cpu_hogs(n: int):
    """`n` processes that spin on a core each for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    print(f"(with {n} CPU-bound processes beside this run)", flush=True)
    try:
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def load(summary: str) -> list[dict]:
    with open(summary) as f:
        return json.load(f)["notebooks"]


def report(changes: list[dict], headlines: dict[str, dict], runs: int) -> None:
    print(f"\n== conclusions whose verdict changed over {runs} runs: {len(changes)} ==")
    for c in changes:
        print(f"\n{c['notebook']}  [{c['key']}]  verdicts: {c['verdicts']}")
        for i, (text, figures) in enumerate(zip(c["texts"], c["figures"]), 1):
            print(f"  run {i}: {text}")
            print(f"         figures: {json.dumps(figures)}")
    print(f"\n== headlines over {runs} runs (median, min-max) ==")
    for notebook, h in headlines.items():
        values = ", ".join(f"{v:.4g}" for v in h["values"])
        print(f"{notebook}: {h['name']} = {h['median']:.4g} {h['unit'] or ''} "
              f"(min {h['low']:.4g}, max {h['high']:.4g}; runs: {values})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="lessons to run (default: every lesson)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="build/conclusions")
    parser.add_argument("--profile", help="run each lesson with this profile (e.g. quick)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds a notebook may run before it is stopped and counted as failed")
    parser.add_argument("--loaded-run", type=int, default=0, metavar="K",
                        help="run the K-th run (1-based) with two CPU-bound processes beside it")
    parser.add_argument("--from", dest="existing", nargs="+", metavar="RUN_DIR",
                        help="compare the summary.json files of runs already made instead of running")
    ns = parser.parse_args()
    if ns.existing:
        summaries = [os.path.join(d, "summary.json") for d in ns.existing]
    else:
        if ns.runs < 2:
            raise SystemExit(f"--runs {ns.runs}: comparing needs at least 2 runs, e.g. --runs 3")
        extra = ["--timeout", f"{ns.timeout:g}"] + (["--profile", ns.profile] if ns.profile else [])
        if not 0 <= ns.loaded_run <= ns.runs:
            raise SystemExit(f"--loaded-run {ns.loaded_run}: name one of the runs 1..{ns.runs}, or 0 for none")
        summaries = []
        for i in range(1, ns.runs + 1):
            with cpu_hogs(2) if i == ns.loaded_run else contextlib.nullcontext():
                summaries.append(run_course(os.path.join(ns.out, f"run{i}"), ns.notebooks, extra))
    runs = [load(s) for s in summaries]
    changes, headlines = conclusion_changes(runs), headline_spread(runs)
    stated = sum(len(r.get("conclusions") or []) for r in runs[0])
    failed = [r["notebook"] for rows in runs for r in rows if r["status"] != "ok"]
    report(changes, headlines, len(runs))
    print(json.dumps({"runs": len(runs), "loaded_run": ns.loaded_run or None, "conclusions_per_run": stated, "changed": len(changes),
                      "changed_keys": [f"{c['notebook']}:{c['key']}" for c in changes],
                      "failed": failed}))


if __name__ == "__main__":
    main()
