"""Notebook helpers: show a function's source, and report a notebook's headline figure."""

from __future__ import annotations

import inspect
import json

HEADLINE_MIME = "application/vnd.pipelab.headline+json"


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


def headline(name: str, value: float, unit: str = "") -> None:
    """Report this notebook's one headline figure (the `pipelab run` summary table reads it)."""
    from IPython.display import display

    text = f"Headline: {name} = {value:.4g} {unit}".rstrip()
    data = {"name": name, "value": float(value), "unit": unit}
    display({HEADLINE_MIME: data, "text/plain": text}, raw=True)


def read_headline(notebook: dict) -> dict | None:
    """The headline an executed notebook reported, or None."""
    for cell in notebook.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if HEADLINE_MIME in data:
                value = data[HEADLINE_MIME]
                return json.loads(value) if isinstance(value, str) else dict(value)
    return None
