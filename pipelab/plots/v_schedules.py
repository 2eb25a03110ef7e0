"""Lesson 13's picture: one Gantt panel per schedule, one legend for every kind any panel draws."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from pipelab.plots import EXPOSED_STYLE, KIND_COLORS, exposed_spans, gantt, kind_color


def schedule_panels(timelines: dict, time_words: str = "modelled"):
    """A panel per schedule (`timelines`: name -> Timeline of one step). Each box says stage, kind
    and micro-batch ("2F0") where it is wide enough, the micro-batch alone where it is narrower."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.7 * len(timelines) + 1.0), sharex=True,
                             squeeze=False)
    kinds, exposed = set(), False
    for ax, (name, tl) in zip(axes[:, 0], timelines.items()):
        gantt(tl, ax=ax, title=f"{name}: {time_words} step {tl.makespan * 1e3:.1f} ms", legend=False,
              label_mb=False, unit=f"ms, {time_words}")
        _label(ax, tl)
        kinds |= {s.kind for s in tl}
        exposed = exposed or bool(exposed_spans(tl))
    for ax in axes[:-1, 0]:
        ax.set_xlabel("")
    order = [k for k in KIND_COLORS if k in kinds] + sorted(kinds - set(KIND_COLORS))
    handles = [Patch(facecolor=kind_color(k), edgecolor="black", label=k) for k in order]
    if exposed:
        handles.append(Patch(facecolor="white", label="exposed: no compute hides it", **EXPOSED_STYLE))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize="small",
               title="kind (box: stage, kind, micro-batch; a narrow box: micro-batch)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    return fig


def _label(ax, tl) -> None:
    """Write each compute box's stage, kind and micro-batch, or its micro-batch alone, as it fits."""
    origin, total = tl.start, tl.makespan * 1e3
    y_of = {row: i for i, row in enumerate(tl.rows())}
    for s in tl.filter(lane="compute"):
        if s.mb is None:
            continue
        width = s.duration * 1e3
        for text in (f"{s.meta.get('stage', '')}{s.kind}{s.mb}", str(s.mb)):
            if width / total > 0.009 * len(text):
                ax.text((s.start - origin) * 1e3 + width / 2, y_of[(s.rank, s.lane)], text, ha="center",
                        va="center", fontsize=6.5, color="white")
                break
