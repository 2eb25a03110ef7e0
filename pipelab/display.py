"""Notebook helpers: show a function's source, report a notebook's headline figure, print tables."""

from __future__ import annotations

import inspect
import json

HEADLINE_MIME = "application/vnd.pipelab.headline+json"
CONCLUSION_MIME = "application/vnd.pipelab.conclusion+json"


def show(obj) -> None:
    """Display the syntax-highlighted source of a pipelab function or class in the notebook.

    Lessons show the code they run instead of copying it into a cell, so what you read is what ran."""
    from IPython.display import display
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    source = inspect.getsource(obj)
    where = f"{inspect.getmodule(obj).__name__}.{getattr(obj, '__qualname__', '')}"
    formatter = HtmlFormatter(style="default", noclasses=True)
    html = f"<div><b><code>{where}</code></b>{highlight(source, PythonLexer(), formatter)}</div>"
    display({"text/html": html, "text/plain": f"# {where}\n{source}"}, raw=True)


def headline(name: str, value, unit: str = "") -> None:
    """Report this notebook's one headline figure (the `pipelab run` summary table reads it).

    `value` is a number or a `measure.Measured`; then the median is the figure and its min-max
    spread over the repeats travels with it."""
    from IPython.display import display

    data = {"name": name, "value": float(getattr(value, "median", value)), "unit": unit}
    if hasattr(value, "values") and f"{value.low:.4g}" != f"{value.high:.4g}":  # a spread, not one figure
        data["low"], data["high"] = float(value.low), float(value.high)
    text = f"Headline: {name} = {data['value']:.4g} {unit}".rstrip()
    if "low" in data:
        text += f" (min {data['low']:.4g}, max {data['high']:.4g} over {len(value.values)} repeats)"
    display({HEADLINE_MIME: data, "text/plain": text}, raw=True)


def conclude(key: str, verdict: str, text: str, figures: dict | None = None, **more) -> None:
    """State a conclusion this run supports, computed from its figures.

    `verdict` is the conclusion in a word or two ('lower', 'within noise', 'fits', ...): the part
    that must not change from run to run. `text` is the sentence the student reads, written from
    the figures; `figures` (a dict, and/or keyword arguments) are the numbers behind it. A lesson's
    verdict function returns (key, verdict, text, figures), so a cell writes `conclude(*verdict)`.
    `benchmarks/conclusions.py` runs the course several times and lists every `key` whose verdict
    changed."""
    from IPython.display import display

    data = {"key": key, "verdict": verdict, "text": text, "figures": _plain({**(figures or {}), **more})}
    display({CONCLUSION_MIME: data, "text/markdown": f"**On this run:** {text}",
             "text/plain": f"On this run: {text}"}, raw=True)


def _plain(figures: dict) -> dict:
    """Figures as JSON can hold them (a `Measured` becomes median/low/high)."""
    out = {}
    for name, value in figures.items():
        if hasattr(value, "median") and hasattr(value, "values"):
            out[name] = {"median": value.median, "low": value.low, "high": value.high}
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
        else:
            out[name] = str(value)
    return out


def read_conclusions(notebook: dict) -> list[dict]:
    """Every conclusion an executed notebook stated, in order."""
    found = []
    for cell in notebook.get("cells", []):
        for out in cell.get("outputs", []):
            value = out.get("data", {}).get(CONCLUSION_MIME)
            if value is not None:
                found.append(json.loads(value) if isinstance(value, str) else dict(value))
    return found


def read_headline(notebook: dict) -> dict | None:
    """The headline an executed notebook reported, or None."""
    for cell in notebook.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if HEADLINE_MIME in data:
                value = data[HEADLINE_MIME]
                return json.loads(value) if isinstance(value, str) else dict(value)
    return None


def format_table(rows: list[dict]) -> str:
    """Rows of figures (dicts with the same keys) as an aligned text table."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[str(k) for k in keys]] + [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def human_bytes(n: float) -> str:
    """A byte count the way people read it: 364 B, 1.50 KiB, 8.00 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def format_bucket_plan(buckets) -> str:
    """A table of a DDP bucket plan (`pipelab.ddp.Bucket`s): each bucket in launch order, its
    size, and its parameters in the order their gradients are expected."""
    rows = [("bucket", "params", "size", "parameters (gradient order)")]
    for b in buckets:
        rows.append((str(b.index), str(len(b.names)), human_bytes(b.nbytes), ", ".join(b.names)))
    total = sum(b.nbytes for b in buckets)
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 27)
    lines.append(f"{len(buckets)} bucket(s), {human_bytes(total)} of gradients per step")
    return "\n".join(lines)
