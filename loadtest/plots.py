"""The charts the benches draw, as side-by-side panels: grouped bars (longctx, mixed, handoff;
a group of bars per x label and a bar per series in a group) and lines (serve-bench: a value
against the offered rate, a line per system)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    title: str
    xlabels: Sequence[str]
    series: Mapping[str, Sequence[float]]  # name -> a value per x label
    labels: str | Sequence[str] | None = None  # on the bars: a format ("%.1f"), or the texts


def grouped_bars(
    path: Path, panels: Sequence[Panel], *, ylabel: str = "", title: str = "", log: bool = False
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        n, width = len(panel.xlabels), 0.8 / len(panel.series)
        for j, (name, values) in enumerate(panel.series.items()):
            bars = ax.bar([i + j * width for i in range(n)], values, width, label=name)
            if isinstance(panel.labels, str):
                ax.bar_label(bars, fmt=panel.labels)
            elif panel.labels is not None:
                ax.bar_label(bars, labels=list(panel.labels), fontsize=8)
        ax.set_xticks([i + width * (len(panel.series) - 1) / 2 for i in range(n)], panel.xlabels)
        ax.set(title=panel.title, ylabel=ylabel)
        if log:
            ax.set_yscale("log")
        if len(panel.series) > 1:
            ax.legend()
    _save(fig, path, title)


@dataclass(frozen=True)
class Line:
    label: str
    x: Sequence[float]
    y: Sequence[float]
    style: str = "o-"
    color: str | None = None  # one colour per system, a style per statistic


@dataclass(frozen=True)
class LinePanel:
    title: str
    lines: Sequence[Line]
    xlabel: str = ""
    ylabel: str = ""
    hline: tuple[float, str] | None = None  # (y, label): a bound drawn across, e.g. an SLO
    log_x: bool = False
    ylim: tuple[float | None, float | None] | None = None


def line_panels(path: Path, panels: Sequence[LinePanel], *, title: str = "") -> None:
    """Side-by-side panels of lines (a value against, say, the offered rate); a line of one
    point draws as its marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        xs: set[float] = set()
        for line in panel.lines:
            ax.plot(line.x, line.y, line.style, label=line.label, color=line.color)
            xs.update(line.x)
        if panel.hline is not None:
            ax.axhline(panel.hline[0], color="red", lw=0.8, ls=":", label=panel.hline[1])
        if panel.log_x and xs and min(xs) > 0:
            ax.set_xscale("log", base=2)
        if xs:
            ticks = sorted(xs)
            ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, title)


def _save(fig: Any, path: Path, title: str) -> None:
    """Title, layout, write ``path`` (its folder made), close."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
