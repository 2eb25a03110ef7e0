"""The emulator against every published measurement the repository holds, table by table.

Each row of `pipelab/emulate/published/*.csv` (a published table: nccl-tests output, matrix-product
and memory benchmarks, each with its source and hardware) beside what the emulator gives for the
same operation on the same hardware: the calibrated model the lessons use, and the data-sheet model
the emulator had before (a flat 50 % of the peak plus 5 us a kernel; ring formulas over the sheet's
link). Rows marked `calibrate` fitted the model; rows marked `check` were held out.

    python benchmarks/emulator_vs_published.py            # the per-table comparison
    python benchmarks/emulator_vs_published.py --rows     # every row as well

Nothing here is timed on this machine: measured figures are the published ones, emulated ones are
modelled. Last line: one JSON object of the summary (fraction within 25 %, median error).
"""

import argparse
import json
import statistics

from pipelab.emulate import measured, validation


def _percent(x: float) -> str:
    return f"{x:+.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="print every row, not only each table's summary")
    args = parser.parse_args()
    now, before = validation.compare(), validation.compare("sheet")
    for row, old in zip(now, before):
        row["sheet_error"] = old["error"]
    tables = measured.tables()
    for name, table in tables.items():
        rows = [r for r in now if r["table"] == name]
        errors = [abs(r["error"]) for r in rows]
        sheet = [abs(r["sheet_error"]) for r in rows]
        print(f"\n{name}: {table.hardware}\n  source: {table.source}\n  use: {table.use}")
        print(f"  {len(rows)} rows ({sum(r['use'] == 'calibrate' for r in rows)} calibrate): "
              f"median error {statistics.median(errors):.1%}, within 25 % {sum(e <= 0.25 for e in errors)}/{len(rows)}; "
              f"data-sheet model: median {statistics.median(sheet):.1%}, within 25 % {sum(e <= 0.25 for e in sheet)}/{len(rows)}")
        if args.rows:
            for r in rows:
                print(f"    {r['use']:<9} {r['what']:<42} measured {r['measured_s'] * 1e6:11.1f} us  "
                      f"emulated {r['emulated_s'] * 1e6:11.1f} us  {_percent(r['error']):>6}  "
                      f"(sheet {_percent(r['sheet_error'])})")
    summary = {"calibrated": validation.summary(now), "sheet": validation.summary(before)}
    print()
    for model in ("calibrated", "sheet"):
        for part in ("all", "check"):
            s = summary[model][part]
            print(f"{model:>10} model, {part:>5} rows ({s['rows']}): within 25 % {s['within_25pct']:.0%}, "
                  f"median error {s['median_error']:.1%}")
    print(json.dumps({"tables": len(tables), "hardware": summary["calibrated"]["hardware"],
                      **{f"{model}_{part}_{key}": round(summary[model][part][key], 4)
                         for model in ("calibrated", "sheet") for part in ("all", "check")
                         for key in ("rows", "within_25pct", "median_error")}}))


if __name__ == "__main__":
    main()
